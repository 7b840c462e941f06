"""Prefix language modelling (Raffel et al. 2020; T5's ``pack_prefix_lm_*``): a random split point per sample.

Decoder-only (``arch="decoder"``): raw ``x (B, T+1)`` gives ``input_ids = x[:, :-1]`` and
``prefix_lengths = p ~ U{1, T-1}``; the backbone attends bidirectionally over the first p inputs and causally
over the rest, and only the suffix ``x[p:]`` is predicted (labels at input positions >= p-1).

Encoder-decoder (``arch="encoder-decoder"``): raw ``x (B, T+1)``, ``p ~ U{1, T}``; the prefix ``x[:p]`` is the
encoder input (right-padded to T) and the rest ``x[p:] + EOS`` the decoder target (padded to T+1, -100).

Packed documents (``document_ids``): every document draws its own split point, as T5 splits each example before
packing. Decoder-only: a document of m inputs (input t belongs to its target's document, as in causal LM) has
``p ~ U{1, m-1}``, its first p inputs in ``prefix_mask`` (bidirectional within the document) and targets after
them. Encoder-decoder: document d's prefix and its suffix + EOS are one example, packed with seqio's segment
semantics (``pretrain.objectives.packing``). A row of one document is exactly the unpacked batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from pretrain.errors import InputError
from pretrain.objectives.base import Objective, document_positions, document_spans, rand_rows, shift_right
from pretrain.objectives.loss import IGNORE_INDEX
from pretrain.objectives.packing import Example, pack_documents


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


def prefix_example(
    tokens: Tensor,
    room_in: int,
    room_out: int,
    generator: torch.Generator,
    eos_id: int,
    mode_id: int | None = None,
) -> tuple[Example, int] | None:
    """One document's prefix-LM example within ``room_in`` encoder and ``room_out`` decoder slots: its first
    n = min(len, room_in + 1 (- 1 with a mode token), room_out) raw tokens split at p ~ U{1, n-1} (p = 1 when n = 1),
    ``([mode] + x[:p], x[p:n] + EOS)``, and n; None when not even one token fits."""
    marks = [] if mode_id is None else [mode_id]
    n = min(len(tokens), room_in + 1 - len(marks), room_out)
    if n < 1 or room_in < 1 + len(marks):
        return None
    p = int(uniform_split([generator], 1, max(1, n - 1))[0])
    inputs = torch.cat([tokens.new_tensor(marks), tokens[:p]])
    return (inputs, torch.cat([tokens[p:n], tokens.new_tensor([eos_id])])), n


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
            raise InputError(f"prefix_lm arch must be 'decoder' or 'encoder-decoder', got {arch!r}")
        self.architectures = frozenset({arch})
        self.arch = arch
        if arch == "encoder-decoder":
            self.eos_id, self.pad_id = self.token_id("eos"), self.token_id("pad")

    def raw_length(self, input_length: int) -> int:
        if input_length < 2:
            raise InputError(f"prefix_lm needs input_length >= 2, got {input_length}")
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

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        L = tokens.shape[1]
        if L < 3:
            raise ValueError(f"prefix_lm needs at least 3 raw tokens per sample, got {L}")
        if self.arch == "encoder-decoder":

            def fit(document: Tensor, room_in: int, room_out: int, generator: torch.Generator):
                return prefix_example(document, room_in, room_out, generator, self.eos_id)

            lengths = (L - 1, L)  # the unpacked batch's
            return pack_documents(tokens, document_ids, generators, lengths, fit, self.pad_id, self.pad_id)
        input_ids = tokens[:, :-1].contiguous()
        documents = document_ids[:, 1:] - document_ids[:, 1:2]  # the target's document, as causal LM
        labels = tokens[:, 1:].clone()
        prefix = torch.zeros_like(input_ids, dtype=torch.bool)
        for b, generator in enumerate(generators):
            for start, end in document_spans(documents[b]):
                p = int(uniform_split([generator], 1, max(1, end - start - 1))[0])
                prefix[b, start : start + p] = True
                labels[b, start : start + p - 1] = IGNORE_INDEX
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": labels,
            "prefix_mask": prefix,
            "document_ids": documents,
            "position_ids": document_positions(documents),
        }
