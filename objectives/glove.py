"""GloVe (Pennington, Socher & Manning 2014): weighted least squares on the log co-occurrence counts.

Co-occurrence (``cooccurrence``), as glove's ``cooccur.c``: tokens outside the vocabulary (count <
``min_count``, special tokens) are removed from the stream, special tokens (EOS) end a document, and every
pair of vocabulary tokens at distance ``1 <= d <= window`` within a document adds ``1/d`` to ``X[w_left,
w_right]`` (and to ``X[w_right, w_left]`` when ``symmetric``).

Loss over the non-zero entries (the model is ``pretrain.models.word_vectors.GloVeModel``)::

    J = Σ_ij f(X_ij) (w_i · w̃_j + b_i + b̃_j - log X_ij)^2,   f(x) = (x / x_max)^α if x < x_max else 1

with ``x_max = 100``, ``α = 3/4`` as published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pretrain.config.compose import check_counts
from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS
from pretrain.errors import InputError
from pretrain.objectives.base import Objective, special_id_table
from pretrain.objectives.sgns import token_counts, vocabulary


def glove_weight(x: Tensor, x_max: float = 100.0, alpha: float = 0.75) -> Tensor:
    """f(x) = (x / x_max)^α for x < x_max, else 1 (GloVe eq. 9)."""
    return torch.where(x < x_max, (x / x_max).pow(alpha), torch.ones_like(x))


@dataclass
class Cooccurrence:
    """Sparse co-occurrence matrix: entries ``X[rows[e], cols[e]] = values[e] > 0``, each ``(E,)``."""

    rows: Tensor
    cols: Tensor
    values: Tensor
    vocab: Tensor  # (V,) bool: the ids that were counted

    def dense(self) -> Tensor:
        """``(V, V)`` float64 (small vocabularies only: tests, inspection)."""
        v = self.vocab.shape[0]
        out = torch.zeros(v, v, dtype=torch.float64)
        out[self.rows, self.cols] = self.values.double()
        return out


def _merge(keys: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sum ``values`` of equal ``keys``: sorted unique keys and their totals."""
    unique, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    return unique, np.bincount(inverse, weights=np.concatenate(values), minlength=len(unique))


def cooccurrence(
    tokens: np.ndarray | Tensor,
    vocab: Tensor,
    boundary: Tensor,
    window: int,
    symmetric: bool = True,
    chunk: int = 1 << 21,
) -> Cooccurrence:
    """Distance-weighted counts of a 1-D token stream (see module doc); ``boundary (V,)`` marks document ends.
    Works in chunks of ``chunk`` tokens (pairs crossing a chunk edge are counted by the left chunk)."""
    check_counts(window=window)
    tokens = torch.as_tensor(np.asarray(tokens).astype(np.int64, copy=False))
    kept = tokens[vocab[tokens] | boundary[tokens]]
    doc = boundary[kept].long().cumsum(0)
    inside = ~boundary[kept]
    words, word_docs = kept[inside].numpy(), doc[inside].numpy()
    v = vocab.shape[0]
    key, value = np.empty(0, np.int64), np.empty(0)
    for start in range(0, len(words), chunk):
        w, d = words[start : start + chunk + window], word_docs[start : start + chunk + window]
        keys, values = [key], [value]
        for dist in range(1, window + 1):
            n = max(0, min(chunk, len(w) - dist))  # left tokens in this chunk with a right partner
            same = d[:n] == d[dist : dist + n]
            left, right = w[:n][same], w[dist : dist + n][same]
            pairs = [left * v + right] + ([right * v + left] if symmetric else [])
            keys += pairs
            values += [np.full(len(left), 1.0 / dist)] * len(pairs)
        key, value = _merge(keys, values)
    return Cooccurrence(
        torch.from_numpy(key // v), torch.from_numpy(key % v), torch.from_numpy(value).float(), vocab
    )


class GloVe:
    """The GloVe objective: builds X from a token stream (``count``) and scores predictions (``loss``).

    Options: ``window`` (10), ``min_count`` (5), ``x_max`` (100), ``alpha`` (0.75), ``symmetric`` (True),
    ``special_tokens`` (role overrides; special tokens are never counted and end documents).
    """

    name = "glove"
    architectures = frozenset({"glove"})
    check_architecture = Objective.check_architecture

    def __init__(
        self,
        tokenizer,
        *,
        window: int = 10,
        min_count: int = 5,
        x_max: float = 100.0,
        alpha: float = 0.75,
        symmetric: bool = True,
        special_tokens: Mapping[str, str] | None = None,
    ):
        check_counts(window=window, min_count=min_count)
        if x_max <= 0 or alpha <= 0:
            raise InputError(f"x_max and alpha must be > 0 (published: 100, 0.75), got {x_max}, {alpha}")
        self.tokenizer = tokenizer
        self.window, self.min_count, self.symmetric = window, min_count, bool(symmetric)
        self.x_max, self.alpha = float(x_max), float(alpha)
        self.special = special_id_table(tokenizer, {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})})

    def count(self, tokens: np.ndarray | Tensor) -> Cooccurrence:
        """Vocabulary (``min_count``) and co-occurrence matrix of a 1-D token stream."""
        counts = token_counts(tokens, self.special.shape[0])
        vocab = vocabulary(counts, self.min_count, self.special)
        return cooccurrence(tokens, vocab, self.special, self.window, self.symmetric)

    def weight(self, x: Tensor) -> Tensor:
        return glove_weight(x, self.x_max, self.alpha)

    def loss(self, prediction: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """``(Σ f(X) (prediction - log X)^2, number of entries)`` for ``prediction, counts (N,)``."""
        diff = prediction.float() - counts.float().log()
        return (self.weight(counts.float()) * diff.square()).sum(), torch.tensor(counts.shape[0])
