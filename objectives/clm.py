"""Causal language modelling (GPT): next-token prediction on packed documents.

Raw tokens ``x (B, T+1)`` give ``input_ids = x[:, :-1]`` and ``labels = x[:, 1:]``.

Packed documents (``document_ids``, from the prepared corpus's document lengths): input position t belongs to the
document of its target ``x[t+1]``, so the EOS that ends a document is the first input of the next one (it plays
BOS, as GPT-2's ``<|endoftext|>``) and predicts that document's first token; positions restart at 0 there. No token
attends across documents, so the loss of a packed row equals the token-weighted loss of its documents run one by
one. A token id never decides a boundary: a document whose text holds the EOS string (or id) stays whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from pretrain.errors import InputError
from pretrain.objectives.base import Objective, document_positions


class CausalLM(Objective):
    """Next-token prediction; option ``special_tokens``."""

    name = "clm"
    architectures = frozenset({"decoder"})
    reports_perplexity = True

    def __init__(self, tokenizer, *, special_tokens: Mapping[str, str] | None = None):
        super().__init__(tokenizer, special_tokens)

    def raw_length(self, input_length: int) -> int:
        if input_length < 1:
            raise InputError(f"input_length must be >= 1, got {input_length}")
        return input_length + 1

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        if tokens.shape[1] < 2:
            raise ValueError(f"clm needs at least 2 raw tokens per sample, got {tokens.shape[1]}")
        input_ids = tokens[:, :-1].contiguous()
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": tokens[:, 1:].contiguous(),
        }

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        out = self.prepare(tokens, generators)
        documents = document_ids[:, 1:] - document_ids[:, 1:2]  # the target's document, from 0
        return {**out, "document_ids": documents, "position_ids": document_positions(documents)}
