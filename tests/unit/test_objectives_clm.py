"""Causal LM (objectives/clm.py): shifting, and document ids / positions from the data, not from the EOS id (the
packed == per-document equality of every objective is ``test_objectives_documents.py``)."""

from __future__ import annotations

import torch
from objective_data import packed_batch, tiny_tokenizer

from pretrain import objectives


def test_inputs_and_labels_are_shifted():
    obj = objectives.build("clm", tiny_tokenizer())
    tokens = packed_batch(3, obj.raw_length(16))
    out = obj(tokens, torch.Generator())
    assert torch.equal(out["input_ids"], tokens[:, :-1]) and torch.equal(out["labels"], tokens[:, 1:])
    assert out["attention_mask"].all() and set(out) == {"input_ids", "attention_mask", "labels"}


def test_each_input_belongs_to_its_targets_document():
    """Raw documents [5 6 E] [7 E] [E] [8 ...]: the EOS ending a document is the first input of the next one (it
    predicts that document's first token); positions restart there. Ids 9 = EOS inside a document change nothing."""
    E = 9
    tokens = torch.tensor([[5, 6, E, 7, E, E, 8, E], [E, 1, E, 3, 4, 5, 6, 7]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [4, 4, 4, 4, 4, 4, 4, 4]])
    out = objectives.build("clm", tiny_tokenizer())(tokens, torch.Generator(), documents)
    assert out["document_ids"].tolist() == [[0, 0, 1, 1, 2, 3, 3], [0, 0, 0, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]


def test_document_ids_must_never_decrease():
    import pytest

    obj = objectives.build("clm", tiny_tokenizer())
    with pytest.raises(ValueError, match="never decrease"):
        obj(torch.zeros(1, 4, dtype=torch.long), torch.Generator(), torch.tensor([[0, 1, 0, 1]]))
