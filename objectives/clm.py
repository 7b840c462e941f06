"""Causal language modelling (GPT): next-token prediction on packed documents separated by EOS.

Raw tokens ``x (B, T+1)`` give ``input_ids = x[:, :-1]`` and ``labels = x[:, 1:]``.

With ``document_masking`` no token attends across documents: an EOS starts a new document (it plays BOS for
the next one, as GPT-2's ``<|endoftext|>``), so ``document_ids`` count the EOS seen so far and ``position_ids``
restart at 0 at every EOS. Every target is then predicted from its own document only, and the loss of a packed
row equals the token-weighted loss of its documents run one by one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from pretrain.objectives.base import Objective


def document_positions(input_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """``(document_ids, position_ids)``, both ``(B, T)``: a document starts at position 0 and at every EOS."""
    starts = input_ids == eos_id
    document_ids = starts.long().cumsum(1)
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return document_ids, index - start_index


class CausalLM(Objective):
    """Next-token prediction; options: ``document_masking`` (needs the eos token), ``special_tokens``."""

    name = "clm"
    architectures = frozenset({"decoder"})
    reports_perplexity = True

    def __init__(
        self, tokenizer, *, document_masking: bool = False, special_tokens: Mapping[str, str] | None = None
    ):
        super().__init__(tokenizer, special_tokens)
        self.document_masking = bool(document_masking)
        self.eos_id = self.token_id("eos") if self.document_masking else None

    def raw_length(self, input_length: int) -> int:
        if input_length < 1:
            raise ValueError(f"input_length must be >= 1, got {input_length}")
        return input_length + 1

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        if tokens.shape[1] < 2:
            raise ValueError(f"clm needs at least 2 raw tokens per sample, got {tokens.shape[1]}")
        input_ids = tokens[:, :-1].contiguous()
        out = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": tokens[:, 1:].contiguous(),
        }
        if self.document_masking:
            out["document_ids"], out["position_ids"] = document_positions(input_ids, self.eos_id)
        return out
