"""T5 span corruption (Raffel et al. 2020), following google-research/text-to-text-transfer-transformer
``t5/data/preprocessors.py``: ``random_spans_noise_mask``, ``random_spans_helper``,
``noise_span_to_unique_sentinel`` and ``nonnoise_span_to_unique_sentinel``.

For a raw chunk of n tokens: ``num_noise = clip(round(n * density), 1, n - 1)``, ``num_nonnoise = n - num_noise``,
``num_spans = max(1, min(round(num_noise / mean_span), num_noise, num_nonnoise))`` (T5 bounds only below; the
upper bound keeps every span non-empty). Noise and non-noise tokens are each split into ``num_spans`` random
non-empty segments (all compositions equally likely) and interleaved, non-noise first. Each noise span becomes
one sentinel ``<extra_id_k>`` (k-th span) in the inputs; the targets are every sentinel followed by its span;
EOS ends both. So inputs have ``num_nonnoise + num_spans + 1`` and targets ``num_noise + num_spans + 1``
tokens whatever the randomness, and ``random_spans_helper`` picks the raw length that fills the encoder input
exactly: input 512 takes 568 raw tokens and gives 114 targets (density 0.15, mean span 3).

Packed documents (``document_ids``): each document of the row is corrupted on its own, as seqio corrupts each
example before packing -- its own noise mask, sentinels numbered from ``<extra_id_0>`` again, EOS after its inputs
and its targets -- and the examples are packed back into the row's encoder and decoder lengths with seqio's
segment semantics (``pretrain.objectives.packing``). A document of one token has no noise (T5 lengthens it to 2
and keeps the first, non-noise, token). Per-document EOS and sentinels cost room, so the last document of a row may
be cut or dropped (``packing.fit_length``); a row of one document is exactly the unpacked batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.datamodules.special_tokens import sentinel_ids, sentinel_token
from pretrain.errors import InputError
from pretrain.objectives.base import Objective, count_sentinels, rand_rows, shift_right
from pretrain.objectives.packing import Example, fit_length, pack_documents


def span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int, int]:
    """``(num_noise, num_nonnoise, num_spans)`` of a raw chunk of ``length >= 2`` tokens."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_nonnoise = length - num_noise
    num_spans = max(1, min(round(num_noise / mean_noise_span_length), num_noise, num_nonnoise))
    return num_noise, num_nonnoise, num_spans


def encoded_lengths(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """``(inputs_length, targets_length)``, EOS included, for a raw chunk of ``length`` tokens."""
    num_noise, num_nonnoise, num_spans = span_counts(length, noise_density, mean_noise_span_length)
    return num_nonnoise + num_spans + 1, num_noise + num_spans + 1


def random_spans_helper(
    inputs_length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
    """T5's ``random_spans_helper`` (one sentinel per span): ``(raw tokens_length, targets_length)``.

    The largest raw length whose encoded inputs fit ``inputs_length``; with density 0.5 one token less when
    that makes the targets longer than the inputs (T5's "minor hack").
    """
    if inputs_length < 3:
        raise InputError(
            f"span corruption needs an input length >= 3 (one token, a sentinel, EOS), got {inputs_length}"
        )
    tokens_length = max(inputs_length - 1, 2)  # encoded inputs never exceed raw length + 1
    while encoded_lengths(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    enc_inputs, targets_length = encoded_lengths(tokens_length, noise_density, mean_noise_span_length)
    if noise_density == 0.5 and targets_length > enc_inputs:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _random_segmentation(keys: Tensor, num_items: int, num_segments: int) -> Tensor:
    """``(B, num_segments)`` positive lengths summing to ``num_items``: segments start after the
    ``num_segments - 1`` smallest of ``keys (B, num_items - 1)``, a uniformly random subset of cut points."""
    cuts = keys.topk(num_segments - 1, dim=1, largest=False).indices.sort(dim=1).values + 1
    B = keys.shape[0]
    bounds = torch.cat([cuts.new_zeros(B, 1), cuts, cuts.new_full((B, 1), num_items)], dim=1)
    return bounds.diff(dim=1)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, generators: list[torch.Generator]
) -> Tensor:
    """``(B, length)`` bool noise mask, row b drawn from ``generators[b]``; spans alternate, non-noise first."""
    num_noise, num_nonnoise, num_spans = span_counts(length, noise_density, mean_noise_span_length)
    keys = rand_rows(generators, (num_noise - 1) + (num_nonnoise - 1))
    noise_lengths = _random_segmentation(keys[:, : num_noise - 1], num_noise, num_spans)
    nonnoise_lengths = _random_segmentation(keys[:, num_noise - 1 :], num_nonnoise, num_spans)
    B = len(generators)
    ends = torch.stack([nonnoise_lengths, noise_lengths], dim=2).reshape(B, 2 * num_spans).cumsum(1)
    edges = torch.zeros(B, length + 1, dtype=torch.long)
    edges.scatter_add_(1, ends[:, 0::2], torch.ones(B, num_spans, dtype=torch.long))  # noise span starts
    edges.scatter_add_(1, ends[:, 1::2], torch.full((B, num_spans), -1))  # noise span ends
    return edges.cumsum(1)[:, :length] > 0


def spans_to_sentinels(tokens: Tensor, span_mask: Tensor, sentinels: Tensor, eos_id: int) -> Tensor:
    """T5's ``noise_span_to_unique_sentinel`` + EOS: each run of ``span_mask`` becomes ``sentinels[k]``
    (k-th run). Every row must have the same number of runs and masked tokens (true of T5 noise masks)."""
    B, n = tokens.shape
    previous = F.pad(span_mask[:, :-1], (1, 0))
    first, later = span_mask & ~previous, span_mask & previous
    num_runs, num_dropped = (int(first[0].sum()), int(later[0].sum())) if B else (0, 0)
    marked = tokens.masked_scatter(first, sentinels[:num_runs].repeat(B))  # row-major: runs 0..k-1 per row
    # move the kept tokens left; dropped ones land in the last column, which EOS then overwrites
    n_kept = n - num_dropped
    destination = torch.where(later, n_kept, (~later).cumsum(1) - 1)
    out = tokens.new_empty(B, n_kept + 1).scatter_(1, destination, marked)
    out[:, n_kept] = eos_id
    return out


def corrupt_spans(
    tokens: Tensor, noise_mask: Tensor, sentinels: Tensor, eos_id: int
) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of T5 span corruption for ``tokens (B, n)`` and its ``noise_mask (B, n)``."""
    return (
        spans_to_sentinels(tokens, noise_mask, sentinels, eos_id),
        spans_to_sentinels(tokens, ~noise_mask, sentinels, eos_id),
    )


def length_table(
    length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs_length, targets_length)`` of a chunk of n raw tokens for n = 0..length, as int arrays; n = 1 has
    no noise (a token and EOS; a sentinel and EOS), n = 0 cannot be corrupted (an impossible length)."""
    lengths = [(1 << 30, 1 << 30), (2, 2)]
    lengths += [encoded_lengths(n, noise_density, mean_noise_span_length) for n in range(2, length + 1)]
    table = np.array(lengths[: length + 1], dtype=np.int64)
    return table[:, 0], table[:, 1]


def corrupt_document(
    tokens: Tensor,
    noise_density: float,
    mean_noise_span_length: float,
    generator: torch.Generator,
    sentinels: Tensor,
    eos_id: int,
) -> Example:
    """T5 span corruption of one document's raw ``tokens (n,)``: ``(inputs, targets)``, each ending with EOS."""
    n = len(tokens)
    if n >= 2:
        noise = random_spans_noise_mask(n, noise_density, mean_noise_span_length, [generator])
    else:
        noise = torch.zeros(1, n, dtype=torch.bool)
    inputs, targets = corrupt_spans(tokens[None], noise, sentinels, eos_id)
    return inputs[0], targets[0]


def check_span_options(noise_density: float, mean_noise_span_length: float) -> None:
    """ValueError unless 0 < density < 1 and mean span length >= 1."""
    if not 0 < noise_density < 1:
        raise InputError(f"noise_density must be in (0, 1), got {noise_density}")
    if mean_noise_span_length < 1:
        raise InputError(f"mean_noise_span_length must be >= 1, got {mean_noise_span_length}")


class SpanCorruption(Objective):
    """T5 span corruption for encoder-decoder models; outputs are fully determined in shape by L."""

    name = "span_corruption"
    architectures = frozenset({"encoder-decoder"})

    def __init__(
        self,
        tokenizer,
        *,
        noise_density: float = 0.15,
        mean_noise_span_length: float = 3.0,
        special_tokens: Mapping[str, str] | None = None,
    ):
        super().__init__(tokenizer, special_tokens)
        check_span_options(noise_density, mean_noise_span_length)
        self.noise_density = noise_density
        self.mean_noise_span_length = mean_noise_span_length
        self.eos_id, self.pad_id = self.token_id("eos"), self.token_id("pad")
        self.sentinels = torch.tensor(sentinel_ids(tokenizer, max(count_sentinels(tokenizer), 1)))
        self.required_tokens += (sentinel_token(0),)

    def check_length(self, length: int) -> None:
        """ValueError unless a raw chunk of ``length`` tokens can be corrupted with this tokenizer."""
        if length < 2:
            raise ValueError(f"span corruption needs at least 2 raw tokens per sample, got {length}")
        num_spans = span_counts(length, self.noise_density, self.mean_noise_span_length)[2]
        if num_spans > len(self.sentinels):
            sentinel_ids(self.tokenizer, num_spans)  # raises, naming the missing sentinel

    def raw_length(self, input_length: int) -> int:
        tokens_length, _ = random_spans_helper(input_length, self.noise_density, self.mean_noise_span_length)
        self.check_length(tokens_length)
        return tokens_length

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        self.check_length(tokens.shape[1])
        noise = random_spans_noise_mask(
            tokens.shape[1], self.noise_density, self.mean_noise_span_length, generators
        )
        inputs, targets = corrupt_spans(tokens, noise, self.sentinels, self.eos_id)
        return {
            "input_ids": inputs,
            "attention_mask": torch.ones_like(inputs),
            "labels": targets,
            "decoder_input_ids": shift_right(targets, self.pad_id, self.pad_id),
        }

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        L = tokens.shape[1]
        self.check_length(L)
        density, mean_span = self.noise_density, self.mean_noise_span_length
        input_length, target_length = encoded_lengths(L, density, mean_span)  # the unpacked batch's lengths
        enc, dec = length_table(L, density, mean_span)

        def fit(document: Tensor, room_in: int, room_out: int, generator: torch.Generator):
            n = fit_length(len(document), L, (enc <= room_in) & (dec <= room_out))
            if n == 0:
                return None
            return corrupt_document(
                document[:n], density, mean_span, generator, self.sentinels, self.eos_id
            ), n

        lengths = (input_length, target_length)
        return pack_documents(tokens, document_ids, generators, lengths, fit, self.pad_id, self.pad_id)
