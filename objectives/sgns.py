"""Word2vec (Mikolov et al. 2013a, b): skip-gram with negative sampling, CBOW, and the full-softmax skip-gram.

On a packed batch of raw token ids ``(B, L)`` (the prepared corpus, as every objective), per row:

1. drop tokens outside the vocabulary (count < ``min_count``, special tokens) and subsample frequent ones:
   token w with corpus frequency f(w) is kept with probability ``min(1, (sqrt(f/t) + 1) t / f)``
   (word2vec.c; the paper's ``1 - sqrt(t/f)`` discard rule smoothed), ``t = subsample`` (0 keeps all);
2. give every remaining position a window ``b ~ U{1..m}`` (word2vec's dynamic window, m = ``window``);
   context = the positions within distance b in the same document (special tokens such as EOS separate
   documents);
3. skip-gram: one example per (center c, context o) pair; CBOW: one example per center, inputs = its context;
4. draw ``k = negatives`` noise words per example from ``P_n(w) ∝ count(w)^(3/4)`` (``noise_power``).

Batch keys (N examples): ``input_ids (N, C)`` (C = 1 center for skip-gram, C = 2m contexts for CBOW) with
``input_mask (N, C)``; negative sampling adds ``candidates (N, 1+k)`` = [target, noise...] and
``labels (N, 1+k)`` = [1, 0, ...]; the full softmax has ``labels (N,)`` = target ids. The model
(``pretrain.models.word_vectors.Word2Vec``) scores candidates (or the whole vocabulary) as ``u_x · v_c``.

Losses per example: negative sampling ``-log σ(u_o·v_c) - Σ_k log σ(-u_k·v_c)``; full softmax
``-log softmax(U v_c)_o``, whose gradient with respect to v_c is ``-(u_o - Σ_x P(x|c) u_x)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.config.compose import check_counts
from pretrain.errors import InputError
from pretrain.objectives.base import Objective, special_id_table
from pretrain.objectives.loss import token_cross_entropy


def token_counts(tokens: np.ndarray | Tensor, vocab_size: int) -> Tensor:
    """``(V,)`` int64 occurrences of every id in a 1-D token stream (e.g. ``IndexedDataset(...).tokens``)."""
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"token id {int(tokens.max())} >= vocab_size {vocab_size}; the data and tokenizer differ"
        )
    return torch.from_numpy(np.bincount(tokens.astype(np.int64, copy=False), minlength=vocab_size))


def vocabulary(counts: Tensor, min_count: int, excluded: Tensor) -> Tensor:
    """``(V,)`` bool: ids occurring at least ``min_count`` times that are not ``excluded`` (special tokens).
    ValueError when nothing is left."""
    check_counts(min_count=min_count)
    vocab = (counts >= min_count) & ~excluded
    if not vocab.any():
        top = int(counts.masked_fill(excluded, 0).max()) if counts.numel() else 0
        raise InputError(
            f"the vocabulary is empty after min-count filtering: no token occurs min_count={min_count} times "
            f"(the most frequent occurs {top} times); lower min_count or train on more text"
        )
    return vocab


def noise_distribution(counts: Tensor, vocab: Tensor, power: float = 0.75) -> Tensor:
    """``(V,)`` float64 ``P_n(w) = c(w)^power / Σ c^power`` over the vocabulary, 0 elsewhere."""
    weights = counts.double().pow(power) * vocab
    return weights / weights.sum()


def keep_probability(counts: Tensor, vocab: Tensor, threshold: float) -> Tensor:
    """``(V,)`` float: word2vec.c subsampling ``min(1, (sqrt(f/t) + 1) t / f)``, f = frequency in the vocabulary;
    1 everywhere in the vocabulary when ``threshold == 0``; 0 outside it."""
    if threshold == 0:
        return vocab.float()
    freq = counts.double() * vocab / (counts * vocab).sum()
    keep = ((freq / threshold).sqrt() + 1) * threshold / freq.clamp_min(1e-30)
    return torch.where(vocab, keep.clamp(max=1.0), 0.0).float()


def window_pairs(doc: Tensor, spans: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """Context positions of each of n positions: ``(index (n, 2m), valid (n, 2m))``; j is a context of i iff
    ``0 < |i - j| <= spans[i]`` and ``doc[i] == doc[j]``. Columns: offsets +1..+m, then -1..-m."""
    n = doc.shape[0]
    offsets = torch.arange(1, window + 1)
    offsets = torch.cat([offsets, -offsets])  # (2m,)
    index = torch.arange(n)[:, None] + offsets  # (n, 2m)
    inside = (index >= 0) & (index < n)
    index = index.clamp(0, max(n - 1, 0))
    valid = inside & (offsets.abs() <= spans[:, None]) & (doc[index] == doc[:, None])
    return index, valid


class SkipGram(Objective):
    """Word2vec examples from raw token rows; options (see module doc): ``counts`` (required, ``(V,)`` corpus
    counts from :func:`token_counts`), ``window``, ``negatives``, ``subsample``, ``min_count``, ``cbow``,
    ``full_softmax``, ``noise_power``, ``special_tokens``."""

    name = "sgns"
    document_mask = False  # context windows run over the token stream, across documents
    architectures = frozenset({"word2vec"})

    def __init__(
        self,
        tokenizer,
        *,
        counts: Sequence[int] | np.ndarray | Tensor,
        window: int = 5,
        negatives: int = 5,
        subsample: float = 1e-3,
        min_count: int = 5,
        cbow: bool = False,
        full_softmax: bool = False,
        noise_power: float = 0.75,
        special_tokens: Mapping[str, str] | None = None,
    ):
        super().__init__(tokenizer, special_tokens)
        check_counts(window=window, negatives=negatives, min_count=min_count)
        if subsample < 0:
            raise InputError(
                f"subsample must be >= 0 (0 disables subsampling; word2vec uses 1e-3), got {subsample}"
            )
        if noise_power < 0:
            raise InputError(f"noise_power must be >= 0 (Mikolov et al.: 0.75), got {noise_power}")
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.long)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if counts.dim() != 1 or counts.numel() != vocab_size:
            raise ValueError(
                f"counts must be one count per token id, shape ({vocab_size},), got {tuple(counts.shape)}; "
                "use pretrain.objectives.sgns.token_counts(train_tokens, vocab_size)"
            )
        self.window, self.negatives, self.subsample = window, negatives, float(subsample)
        self.cbow, self.full_softmax = bool(cbow), bool(full_softmax)
        self.special = special_id_table(tokenizer, self.special_tokens)
        self.vocab = vocabulary(counts, min_count, self.special)
        self.counts = counts
        self.noise = noise_distribution(counts, self.vocab, noise_power)
        self.keep = keep_probability(counts, self.vocab, self.subsample)

    def raw_length(self, input_length: int) -> int:
        if input_length < 2:
            raise InputError(
                f"input_length must be >= 2 tokens to hold a (center, context) pair, got {input_length}"
            )
        return input_length

    def _row(self, tokens: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
        """Examples of one row ``tokens (L,)``: inputs (n, C), mask (n, C), targets (n,), noise (n, k)."""
        doc = self.special[tokens].long().cumsum(0)  # special tokens (EOS) separate documents
        keep = torch.rand(tokens.shape[0], generator=generator) < self.keep[tokens]
        words, doc = tokens[keep], doc[keep]  # (n,)
        spans = torch.randint(1, self.window + 1, words.shape, generator=generator)
        index, valid = window_pairs(doc, spans, self.window)  # (n, 2m)
        if self.cbow:
            rows = valid.any(1)
            inputs, mask, targets = words[index[rows]], valid[rows], words[rows]
        else:
            center, context = valid.nonzero(as_tuple=True)
            inputs, targets = words[center][:, None], words[index[center, context]]
            mask = torch.ones_like(inputs, dtype=torch.bool)
        n = targets.shape[0]
        noise = (
            torch.multinomial(self.noise, n * self.negatives, replacement=True, generator=generator).view(
                n, -1
            )
            if n and not self.full_softmax
            else torch.empty(n, self.negatives, dtype=torch.long)
        )
        return {"inputs": inputs, "mask": mask, "targets": targets, "noise": noise}

    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        rows = [self._row(row, g) for row, g in zip(tokens, generators)]
        cat = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
        out = {"input_ids": cat["inputs"], "input_mask": cat["mask"]}
        if self.full_softmax:
            out["labels"] = cat["targets"]
        else:
            out["candidates"] = torch.cat([cat["targets"][:, None], cat["noise"]], dim=1)  # (N, 1+k)
            labels = torch.zeros(out["candidates"].shape)
            labels[:, 0] = 1.0
            out["labels"] = labels
        return out

    def loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(summed example loss, number of examples)``; logits ``(N, 1+k)`` (negative sampling) or ``(N, V)``."""
        if self.full_softmax:
            return token_cross_entropy(logits, labels)
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")
        return loss_sum, torch.tensor(labels.shape[0])

    def metrics(self, logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """``num_correct``: the target outscores every noise word (negative sampling) or is the argmax."""
        if self.full_softmax:
            return super().metrics(logits, labels)
        loss_sum, num_targets = self.loss(logits, labels)
        num_correct = (logits.detach().argmax(-1) == 0).sum()
        return {"loss_sum": loss_sum.detach(), "num_targets": num_targets, "num_correct": num_correct}
