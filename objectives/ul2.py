"""UL2 mixture of denoisers (Tay et al. 2022, "UL2: Unifying Language Learning Paradigms") for
encoder-decoder models.

Each example picks one denoiser, with probability proportional to its weight (default: the 7 below, equally):

- R (regular, mode token ``[NLU]``): T5 span corruption, mean span 3 and 8, density 0.15;
- S (sequential, ``[S2S]``): prefix LM, a uniform split point, prefix -> encoder, rest + EOS -> decoder;
- X (extreme, ``[NLG]``): span corruption with mean span 3 and 8 at density 0.5, mean span 64 at 0.15 and 0.5.

The mode token is prepended to the encoder input. Outputs are padded to fixed lengths: encoder
``input_length`` (pad, attention_mask 0), decoder ``target_length`` (labels -100). Each denoiser uses the
longest raw prefix of the sample that fits both lengths (``raw_length`` = the longest of these over denoisers;
shorter denoisers ignore the sample's tail).

Packed documents (``document_ids``): every document is an example, as seqio mixes UL2's tasks per example: it draws
its own denoiser, gets its own mode token, noise or split point and sentinels from ``<extra_id_0>``, and the examples
are packed back into the row's lengths with seqio's segment semantics (``pretrain.objectives.packing``; a document
that does not fit whole is cut at the longest prefix that does, capped at its denoiser's raw length, and the row's
later documents are dropped). A row of one document is exactly the unpacked batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from pretrain.datamodules.special_tokens import UL2_MODE_TOKENS, sentinel_ids, sentinel_token
from pretrain.errors import InputError
from pretrain.objectives.base import Objective, count_sentinels, rand_rows
from pretrain.objectives.loss import IGNORE_INDEX
from pretrain.objectives.packing import Example, fit_length, pack_documents
from pretrain.objectives.prefix_lm import encoder_decoder_batch, prefix_example, split_prefix, uniform_split
from pretrain.objectives.span_corruption import (
    check_span_options,
    corrupt_document,
    corrupt_spans,
    encoded_lengths,
    length_table,
    random_spans_noise_mask,
    span_counts,
)

DEFAULT_DENOISERS: tuple[dict, ...] = (
    {"mode": "R", "mean_noise_span_length": 3.0, "noise_density": 0.15},
    {"mode": "R", "mean_noise_span_length": 8.0, "noise_density": 0.15},
    {"mode": "S"},
    {"mode": "X", "mean_noise_span_length": 3.0, "noise_density": 0.5},
    {"mode": "X", "mean_noise_span_length": 8.0, "noise_density": 0.5},
    {"mode": "X", "mean_noise_span_length": 64.0, "noise_density": 0.15},
    {"mode": "X", "mean_noise_span_length": 64.0, "noise_density": 0.5},
)
DENOISER_KEYS = frozenset({"mode", "mean_noise_span_length", "noise_density", "weight"})


def _span_raw_length(input_length: int, target_length: int, density: float, mean_span: float) -> int:
    """Longest raw chunk whose corrupted inputs (plus the mode token) and targets fit; 0 if none does."""
    n = 1
    while True:
        enc, dec = encoded_lengths(n + 1, density, mean_span)
        if enc + 1 > input_length or dec > target_length:
            return n if n >= 2 else 0
        n += 1


class UL2(Objective):
    """Mixture of denoisers; options ``input_length``, ``target_length`` (default = input_length),
    ``denoisers`` (dicts with ``mode`` R/S/X, ``noise_density``, ``mean_noise_span_length``, ``weight``)."""

    name = "ul2"
    architectures = frozenset({"encoder-decoder"})
    sparse_targets = True  # R/X targets are short, padded to target_length with -100

    def __init__(
        self,
        tokenizer,
        *,
        input_length: int,
        target_length: int | None = None,
        denoisers: Sequence[Mapping] | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ):
        super().__init__(tokenizer, special_tokens)
        self.input_length = int(input_length)
        self.target_length = int(target_length or input_length)
        self.eos_id, self.pad_id = self.token_id("eos"), self.token_id("pad")
        self.denoisers = [self._check_denoiser(dict(d)) for d in (denoisers or DEFAULT_DENOISERS)]
        weights = torch.tensor([float(d.get("weight", 1.0)) for d in self.denoisers])
        if (weights < 0).any() or weights.sum() <= 0:
            raise InputError(f"denoiser weights must be >= 0 with a positive sum, got {weights.tolist()}")
        self.cum_weights = (weights / weights.sum()).cumsum(0)
        self.mode_ids = [self._mode_id(d["mode"]) for d in self.denoisers]
        self.lengths = [self._denoiser_raw_length(d) for d in self.denoisers]
        self.sentinels = torch.tensor(sentinel_ids(tokenizer, count_sentinels(tokenizer)), dtype=torch.long)
        for d, n in zip(self.denoisers, self.lengths):
            if d["mode"] != "S":
                num_spans = span_counts(n, d["noise_density"], d["mean_noise_span_length"])[2]
                self.required_tokens += tuple(sentinel_token(i) for i in range(num_spans))
                sentinel_ids(tokenizer, num_spans)  # raises, naming the missing sentinel
        self.required_tokens = tuple(dict.fromkeys(self.required_tokens))

    @staticmethod
    def _check_denoiser(d: dict) -> dict:
        if d.get("mode") not in UL2_MODE_TOKENS or set(d) - DENOISER_KEYS:
            raise InputError(
                f"bad UL2 denoiser {d}: 'mode' must be one of {sorted(UL2_MODE_TOKENS)} and the keys among "
                f"{sorted(DENOISER_KEYS)}"
            )
        if d["mode"] == "S":
            if {"noise_density", "mean_noise_span_length"} & set(d):
                raise InputError(f"the S denoiser (prefix LM) takes no span options, got {d}")
        else:
            d.setdefault("noise_density", 0.15)
            d.setdefault("mean_noise_span_length", 3.0)
            check_span_options(d["noise_density"], d["mean_noise_span_length"])
        return d

    def _mode_id(self, mode: str) -> int:
        token = UL2_MODE_TOKENS[mode]
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise InputError(
                f"the tokenizer has no UL2 mode token {token!r} ({mode} denoiser); train the tokenizer with "
                "all special tokens (pretrain.datamodules.special_tokens.all_special_tokens)"
            )
        self.required_tokens += (token,)
        return token_id

    def _denoiser_raw_length(self, d: dict) -> int:
        if d["mode"] == "S":
            n = min(self.input_length, self.target_length)
        else:
            n = _span_raw_length(
                self.input_length, self.target_length, d["noise_density"], d["mean_noise_span_length"]
            )
        if n < 2:
            raise InputError(
                f"input_length={self.input_length} / target_length={self.target_length} are too short for the "
                f"UL2 denoiser {d}; raise them"
            )
        return n

    def raw_length(self, input_length: int) -> int:
        if input_length != self.input_length:
            raise ValueError(
                f"ul2 was built for input_length={self.input_length}, asked for {input_length}; build it with "
                f"input_length={input_length}"
            )
        return max(self.lengths)

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        B, L = tokens.shape
        if L < max(self.lengths):
            raise ValueError(f"ul2 needs {max(self.lengths)} raw tokens per sample (raw_length), got {L}")
        choice = self._choose(generators)
        inputs = tokens.new_full((B, self.input_length), self.pad_id)
        input_lengths = tokens.new_zeros(B)
        labels = tokens.new_full((B, self.target_length), IGNORE_INDEX)
        for k, (d, n, mode_id) in enumerate(zip(self.denoisers, self.lengths, self.mode_ids)):
            rows = (choice == k).nonzero().squeeze(1)
            if len(rows) == 0:
                continue
            gens = [generators[i] for i in rows.tolist()]
            x = tokens[rows, :n]
            if d["mode"] == "S":
                split = uniform_split(gens, 1, n - 1)
                enc, dec = split_prefix(
                    x,
                    split,
                    self.input_length - 1,
                    self.target_length,
                    pad_id=self.pad_id,
                    eos_id=self.eos_id,
                )
                input_lengths[rows] = split + 1
            else:
                noise = random_spans_noise_mask(n, d["noise_density"], d["mean_noise_span_length"], gens)
                enc, dec = corrupt_spans(x, noise, self.sentinels, self.eos_id)
                input_lengths[rows] = enc.shape[1] + 1
            inputs[rows, : enc.shape[1] + 1] = torch.cat([enc.new_full((len(rows), 1), mode_id), enc], dim=1)
            labels[rows, : dec.shape[1]] = dec
        return encoder_decoder_batch(inputs, input_lengths, labels, self.pad_id)

    def _choose(self, generators: list[torch.Generator]) -> Tensor:
        """``(B,)`` denoiser of each generator's next example."""
        choice = torch.searchsorted(self.cum_weights, rand_rows(generators, 1)[:, 0], right=True)
        return choice.clamp_max(len(self.denoisers) - 1)

    def _example(
        self, k: int, tokens: Tensor, room_in: int, room_out: int, generator: torch.Generator
    ) -> tuple[Example, int] | None:
        """Denoiser ``k``'s example of one document's raw ``tokens`` within the room left, and the raw tokens it
        used (at most the denoiser's raw length); None when nothing fits."""
        d, cap, mode_id = self.denoisers[k], self.lengths[k], self.mode_ids[k]
        if d["mode"] == "S":
            return prefix_example(tokens[:cap], room_in, room_out, generator, self.eos_id, mode_id)
        table = self._tables[k]
        assert table is not None  # built for every mode but S
        enc, dec = table
        n = fit_length(len(tokens), cap, (enc + 1 <= room_in) & (dec <= room_out))
        if n == 0:
            return None
        density, mean_span = d["noise_density"], d["mean_noise_span_length"]
        inputs, targets = corrupt_document(
            tokens[:n], density, mean_span, generator, self.sentinels, self.eos_id
        )
        return (torch.cat([inputs.new_tensor([mode_id]), inputs]), targets), n

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        L = tokens.shape[1]
        if L < max(self.lengths):
            raise ValueError(f"ul2 needs {max(self.lengths)} raw tokens per sample (raw_length), got {L}")
        if not hasattr(self, "_tables"):
            self._tables: list[tuple[np.ndarray, np.ndarray] | None] = [
                length_table(n, d["noise_density"], d["mean_noise_span_length"]) if d["mode"] != "S" else None
                for d, n in zip(self.denoisers, self.lengths, strict=True)
            ]

        def fit(document: Tensor, room_in: int, room_out: int, generator: torch.Generator):
            k = int(self._choose([generator])[0])  # every document draws its denoiser
            return self._example(k, document, room_in, room_out, generator)

        lengths = (self.input_length, self.target_length)
        return pack_documents(tokens, document_ids, generators, lengths, fit, self.pad_id, self.pad_id)
