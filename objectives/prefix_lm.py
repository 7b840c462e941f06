"""Prefix language modelling (Raffel et al. 2020; T5's ``pack_prefix_lm_*``): a random split point per sample.

Decoder-only (``arch="decoder"``): raw ``x (B, T+1)`` gives ``input_ids = x[:, :-1]`` and
``prefix_lengths = p ~ U{1, T-1}``; the backbone attends bidirectionally over the first p inputs and causally
over the rest, and only the suffix ``x[p:]`` is predicted (labels at input positions >= p-1).

Encoder-decoder (``arch="encoder-decoder"``): raw ``x (B, T+1)``, ``p ~ U{1, T}``; the prefix ``x[:p]`` is the
encoder input (right-padded to T) and the rest ``x[p:] + EOS`` the decoder target (padded to T+1, -100).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from pretrain.objectives.base import Objective, rand_rows, shift_right
from pretrain.objectives.loss import IGNORE_INDEX


def uniform_split(generators: list[torch.Generator], low: int, high: int) -> Tensor:
    """``(B,)`` split points, uniform on {low, ..., high}, row b from ``generators[b]``."""
    u = rand_rows(generators, 1)[:, 0]
    return (low + (u * (high - low + 1)).long()).clamp_max(high)


def split_prefix(
    tokens: Tensor, split: Tensor, input_length: int, target_length: int, *, pad_id: int, eos_id: int
) -> tuple[Tensor, Tensor]:
    """Encoder inputs ``tokens[:, :split]`` padded to ``(B, input_length)`` and targets
    ``tokens[:, split:] + EOS`` padded with -100 to ``(B, target_length)``; both must fit."""
    B, n = tokens.shape
    positions = torch.arange(max(n, target_length)).expand(B, -1)
    inputs = torch.where(positions[:, :n] < split[:, None], tokens, pad_id)[:, :input_length]
    inputs = torch.cat([inputs, inputs.new_full((B, input_length - inputs.shape[1]), pad_id)], dim=1)
    index = split[:, None] + positions[:, :target_length]
    with_eos = torch.cat([tokens, tokens.new_full((B, 1), eos_id)], dim=1)
    targets = with_eos.gather(1, index.clamp_max(n)).masked_fill(index > n, IGNORE_INDEX)
    return inputs, targets


def encoder_decoder_batch(
    inputs: Tensor, input_lengths: Tensor, labels: Tensor, pad_id: int
) -> dict[str, Tensor]:
    """Right-padded encoder inputs ``(B, T)`` with their ``input_lengths (B,)`` and labels ``(B, T')``
    -> the model's keyword arguments (decoder start token = pad, as T5)."""
    return {
        "input_ids": inputs,
        "attention_mask": (torch.arange(inputs.shape[1]) < input_lengths[:, None]).long(),
        "labels": labels,
        "decoder_input_ids": shift_right(labels, pad_id, pad_id),
        "decoder_attention_mask": (labels != IGNORE_INDEX).long(),  # decoder inputs that predict a target
    }


class PrefixLM(Objective):
    """Prefix LM on a decoder (``prefix_lengths``) or an encoder-decoder (prefix -> encoder)."""

    name = "prefix_lm"
    reports_perplexity = True
    sparse_targets = True  # the suffix only (half of the positions on average)

    def __init__(self, tokenizer, *, arch: str = "decoder", special_tokens: Mapping[str, str] | None = None):
        super().__init__(tokenizer, special_tokens)
        if arch not in ("decoder", "encoder-decoder"):
            raise ValueError(f"prefix_lm arch must be 'decoder' or 'encoder-decoder', got {arch!r}")
        self.architectures = frozenset({arch})
        self.arch = arch
        if arch == "encoder-decoder":
            self.eos_id, self.pad_id = self.token_id("eos"), self.token_id("pad")

    def raw_length(self, input_length: int) -> int:
        if input_length < 2:
            raise ValueError(f"prefix_lm needs input_length >= 2, got {input_length}")
        return input_length + 1

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        L = tokens.shape[1]
        if L < 3:
            raise ValueError(f"prefix_lm needs at least 3 raw tokens per sample, got {L}")
        if self.arch == "encoder-decoder":
            split = uniform_split(generators, 1, L - 1)
            inputs, labels = split_prefix(tokens, split, L - 1, L, pad_id=self.pad_id, eos_id=self.eos_id)
            return encoder_decoder_batch(inputs, split, labels, self.pad_id)
        split = uniform_split(generators, 1, L - 2)
        input_ids = tokens[:, :-1].contiguous()
        in_prefix = torch.arange(L - 1) < (split[:, None] - 1)
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": tokens[:, 1:].masked_fill(in_prefix, IGNORE_INDEX),
            "prefix_lengths": split,
        }
