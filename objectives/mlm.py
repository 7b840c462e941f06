"""Masked language modelling (BERT / RoBERTa without next-sentence prediction).

Selection: each non-special position is selected with probability ``mlm_probability`` (0.15); a selected
token becomes the mask token with probability ``mask_replace_prob`` (0.8), a random non-special token with
probability ``random_replace_prob`` (0.1), and stays unchanged otherwise. ``labels`` hold the original
token at selected positions and -100 elsewhere. Special tokens are never selected nor used as replacements.

Selection units: tokens, or whole words (``whole_word_mask``: a word is a token that starts a word — 'Ġ'/'▁'
prefix, or no '##' prefix for WordPiece — plus the tokens that continue it; every token of a selected word is
selected). With ``span_masking`` (SpanBERT, Joshi et al. 2020) contiguous spans of units are selected, span
lengths drawn from a geometric distribution (``span_p`` = 0.2) truncated to ``max_span_length`` (10) units
(mean 3.8), and the 80/10/10 decision is taken once per span. Span starts are Bernoulli(q) with q solved so
that each unit is covered with probability ``mlm_probability``:

    1 - prod_{k=0}^{M-1} (1 - q * P(len > k)) = mlm_probability.

Packed pretraining input ``x (B, T-2)`` becomes ``[CLS] x [SEP]``. With packed documents (``document_ids``),
[CLS] joins the row's first document and [SEP] its last, positions restart in every document, a word or span
never continues across a boundary (a span reaching into the next document is two runs there, each with its own
80/10/10 decision), and each token is still selected with probability ``mlm_probability``: the statistics hold per
document, spans being cut at document ends as they are at the row's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from pretrain.errors import InputError
from pretrain.objectives.base import (
    Objective,
    document_positions,
    document_starts,
    lookup,
    rand_rows,
    special_id_table,
)
from pretrain.objectives.loss import IGNORE_INDEX

WORD_MARKERS = ("Ġ", "▁", "##")  # byte-level BPE, SentencePiece (word starts) and WordPiece (continuations)


def word_start_table(tokenizer) -> Tensor:
    """``(V,)`` bool: does token id v start a word? Derived once from the vocabulary's word-boundary marker."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    counts = {m: sum(token.startswith(m) for token in vocab) for m in WORD_MARKERS}
    marker = max(counts, key=counts.__getitem__)
    if counts[marker] == 0:
        raise InputError(
            f"cannot derive word boundaries: no vocabulary token starts with any of {WORD_MARKERS}; "
            "use whole_word_mask=False"
        )
    table = torch.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=torch.bool)
    for token, i in vocab.items():
        table[i] = not token.startswith(marker) if marker == "##" else token.startswith(marker)
    return table


def span_length_survival(span_p: float, max_span_length: int) -> Tensor:
    """``P(len > k)`` for k = 0..M-1 of the geometric(span_p) length truncated (renormalised) to 1..M."""
    k = torch.arange(max_span_length, dtype=torch.float64)
    norm = 1 - (1 - span_p) ** max_span_length
    return ((1 - span_p) ** k - (1 - span_p) ** max_span_length) / norm


def span_start_probability(coverage: float, survival: Tensor) -> float:
    """Solve ``1 - prod_k (1 - q * survival[k]) = coverage`` for q in (0, 1] by bisection."""
    lo, hi = 0.0, 1.0  # q = 1 covers every unit since survival[0] = 1
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if 1 - torch.prod(1 - q * survival).item() < coverage else (lo, q)
    return (lo + hi) / 2


class MaskedLM(Objective):
    """BERT-style masking; see the module docstring for the options."""

    name = "mlm"
    architectures = frozenset({"encoder"})
    sparse_targets = True  # mlm_probability of the positions

    def __init__(
        self,
        tokenizer,
        *,
        mlm_probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        whole_word_mask: bool = False,
        span_masking: bool = False,
        span_p: float = 0.2,
        max_span_length: int = 10,
        special_tokens: Mapping[str, str] | None = None,
    ):
        super().__init__(tokenizer, special_tokens)
        if not 0 < mlm_probability < 1:
            raise InputError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if mask_replace_prob < 0 or random_replace_prob < 0 or mask_replace_prob + random_replace_prob > 1:
            raise InputError(
                "mask_replace_prob and random_replace_prob must be >= 0 with a sum <= 1, got "
                f"{mask_replace_prob} and {random_replace_prob}"
            )
        if not 0 < span_p <= 1 or max_span_length < 1:
            raise InputError(
                f"need 0 < span_p <= 1 and max_span_length >= 1, got {span_p}, {max_span_length}"
            )
        self.mlm_probability = mlm_probability
        self.mask_replace_prob = mask_replace_prob
        self.random_replace_prob = random_replace_prob
        self.mask_id, self.cls_id, self.sep_id = (self.token_id(r) for r in ("mask", "cls", "sep"))
        self.pad_id = self.token_id("pad")
        self.is_special = special_id_table(tokenizer, self.special_tokens)
        self.replacement_ids = (~self.is_special).nonzero().squeeze(1)
        if len(self.replacement_ids) == 0:
            raise InputError("the tokenizer has no non-special tokens to use as random replacements")
        self.starts_word = word_start_table(tokenizer) if whole_word_mask else None
        self.max_span_length = max_span_length if span_masking else 1
        if span_masking:
            self.survival = span_length_survival(span_p, max_span_length)
            self.span_start_p = span_start_probability(mlm_probability, self.survival)
            self.log_1mp = math.log1p(-span_p) if span_p < 1 else -math.inf

    def raw_length(self, input_length: int) -> int:
        if input_length < 3:
            raise InputError(f"mlm adds [CLS] and [SEP]: input_length must be >= 3, got {input_length}")
        return input_length - 2

    def prepare(
        self, tokens: Tensor, generators: list[torch.Generator], documents: Tensor | None = None
    ) -> dict[str, Tensor]:
        """``documents``: the (B, T) document ids of ``[CLS] x [SEP]`` (see ``prepare_documents``)."""
        B = tokens.shape[0]
        input_ids = torch.cat(
            [tokens.new_full((B, 1), self.cls_id), tokens, tokens.new_full((B, 1), self.sep_id)], dim=1
        )
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        return self._mask(batch, generators, documents)

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        documents = torch.cat(
            [document_ids[:, :1], document_ids, document_ids[:, -1:]], dim=1
        )  # [CLS], [SEP]
        batch = self.prepare(tokens, generators, documents)
        return {**batch, "document_ids": documents, "position_ids": document_positions(documents)}

    def _unit_ids(self, input_ids: Tensor, special: Tensor, starts: Tensor | None = None) -> Tensor | None:
        """``(B, T)`` index of each token's word (its selection unit), or None when units are tokens; a document
        start (``starts``) starts a word."""
        if self.starts_word is None:
            return None
        boundary = lookup(self.starts_word, input_ids) | special
        if starts is not None:
            boundary |= starts
        boundary[:, 1:] |= special[:, :-1]
        boundary[:, 0] = True
        return boundary.long().cumsum(1) - 1

    def _select_units(self, u_start: Tensor, u_length: Tensor) -> Tensor:
        """``(B, G)`` selected units from per-unit uniforms; spans are laid out on a grid padded by M-1."""
        if self.max_span_length == 1:
            return u_start < self.mlm_probability
        M = self.max_span_length
        starts = u_start < self.span_start_p
        c = 1 - math.exp(M * self.log_1mp)
        lengths = (torch.log1p(-u_length * c) / self.log_1mp).floor().long().add(1).clamp(1, M)
        G = u_start.shape[1]
        diff = torch.zeros(u_start.shape[0], G + M, dtype=torch.long)
        index = torch.arange(G).expand_as(starts)
        diff.scatter_add_(1, index, starts.long())
        diff.scatter_add_(1, index + lengths, -starts.long())
        return diff.cumsum(1)[:, M - 1 : G] > 0

    def _mask(
        self, batch: dict[str, Tensor], generators: list[torch.Generator], documents: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Select and replace tokens of ``batch["input_ids"]`` (B, T); ``documents`` (B, T): no unit or run
        continues across a document start."""
        input_ids = batch["input_ids"]
        starts = None if documents is None else document_starts(documents)
        T = input_ids.shape[1]
        G = T + self.max_span_length - 1
        u = rand_rows(generators, (2 * G if self.max_span_length > 1 else G) + 2 * T)
        u_start, u_length = u[:, :G], u[:, G : 2 * G]
        u_decide, u_random = u[:, -2 * T : -T], u[:, -T:]

        special = lookup(self.is_special, input_ids)
        unit = self._unit_ids(input_ids, special, starts)
        selected = self._select_units(u_start, u_length)
        selected = (selected if unit is None else selected.gather(1, unit)) & ~special
        if self.max_span_length > 1:  # one decision per selected run (SpanBERT masks spans as a whole)
            run_start = selected.clone()
            run_start[:, 1:] &= ~selected[:, :-1]
            if starts is not None:  # a run reaching into the next document starts again there
                run_start |= selected & starts
            index = torch.arange(T).expand_as(input_ids)
            first = torch.where(run_start, index, torch.zeros_like(index)).cummax(1).values
            u_decide = u_decide.gather(1, first)
        to_mask = selected & (u_decide < self.mask_replace_prob)
        to_random = selected & ~to_mask & (u_decide < self.mask_replace_prob + self.random_replace_prob)

        masked = torch.where(to_mask, self.mask_id, input_ids)
        where_random = to_random.nonzero(as_tuple=True)
        n = len(self.replacement_ids)
        masked[where_random] = self.replacement_ids[(u_random[where_random] * n).long().clamp_max(n - 1)]
        batch["input_ids"] = masked
        batch["labels"] = torch.where(selected, input_ids, IGNORE_INDEX)
        batch.setdefault("attention_mask", torch.ones_like(input_ids))
        return batch
