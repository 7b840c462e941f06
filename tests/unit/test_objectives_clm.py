"""Causal LM (objectives/clm.py): shifting, document masking, and packed loss == per-document loss."""

from __future__ import annotations

import itertools

import pytest
import torch
from objective_data import packed_batch, tiny_model, tiny_tokenizer

from pretrain import objectives
from pretrain.objectives.clm import document_positions


def test_inputs_and_labels_are_shifted():
    obj = objectives.build("clm", tiny_tokenizer())
    tokens = packed_batch(3, obj.raw_length(16))
    out = obj(tokens, torch.Generator())
    assert torch.equal(out["input_ids"], tokens[:, :-1]) and torch.equal(out["labels"], tokens[:, 1:])
    assert out["attention_mask"].all() and set(out) == {"input_ids", "attention_mask", "labels"}


def test_document_positions_restart_at_every_eos():
    E = 9
    doc, pos = document_positions(torch.tensor([[5, 6, E, 7, E, E, 8], [E, 1, 2, 3, 4, 5, 6]]), E)
    assert doc.tolist() == [[0, 0, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]


def split_documents(raw: torch.Tensor, eos_id: int) -> list[torch.Tensor]:
    """A packed raw row cut before every EOS (the EOS opens the next document), each piece keeping one
    token of look-ahead as its last label: documents as they would be fed one by one."""
    cuts = [0] + [i for i in range(1, len(raw) - 1) if raw[i] == eos_id] + [len(raw) - 1]
    return [raw[a : b + 1] for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_loss_equals_token_weighted_loss_of_documents(seed):
    tok = tiny_tokenizer()
    eos = tok.token_to_id("</s>")
    obj = objectives.build("clm", tok, document_masking=True)
    tokens = packed_batch(3, obj.raw_length(96), seed=seed)
    tokens[:, 40:43] = eos  # include empty documents
    model, logits_of = tiny_model("decoder", tok.get_vocab_size())
    batch = obj(tokens, torch.Generator())
    labels = batch.pop("labels")
    with torch.no_grad():
        packed_sum, packed_n = obj.loss(logits_of(model, **batch), labels)
        doc_sum, doc_n, num_docs = 0.0, 0, 0
        for row in tokens:
            for doc in split_documents(row, eos):
                single = objectives.build("clm", tok)(doc[None], torch.Generator())
                s, n = obj.loss(logits_of(model, input_ids=single["input_ids"]), single["labels"])
                doc_sum, doc_n, num_docs = doc_sum + s, doc_n + n, num_docs + 1
    assert num_docs > 3 * 3 and packed_n == doc_n == 3 * 96
    torch.testing.assert_close(packed_sum / packed_n, doc_sum / doc_n, rtol=1e-5, atol=1e-5)

    with torch.no_grad():  # the check has teeth: without document masking the loss differs
        plain = objectives.build("clm", tok)(tokens, torch.Generator())
        leaky_sum, _ = obj.loss(logits_of(model, input_ids=plain["input_ids"]), plain["labels"])
    assert not torch.allclose(leaky_sum, packed_sum, rtol=1e-4)


def test_document_masking_needs_eos():
    from tokenizers import Tokenizer, models

    no_eos = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    objectives.build("clm", no_eos)  # plain CLM needs no special token
    with pytest.raises(ValueError, match="no eos token"):
        objectives.build("clm", no_eos, document_masking=True)
