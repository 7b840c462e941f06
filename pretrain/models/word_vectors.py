"""Static word vectors: the word2vec and GloVe models, and their evaluation and export.

Models (V vocabulary, d dimensions; the objectives live in ``pretrain.objectives.sgns`` / ``pretrain.objectives.glove``):

- ``Word2Vec``: center (input) vectors v and context (output) vectors u, both (V, d). An example with inputs
  ``x_1..x_C`` (the center for skip-gram, the context window for CBOW) has ``h = mean_i v_{x_i}`` and scores
  ``u_y · h`` for candidates y (negative sampling) or for the whole vocabulary (full softmax). Initialised as
  word2vec.c: v ~ U(-0.5/d, 0.5/d), u = 0.
- ``GloVeModel``: word and context vectors w, w̃ (V, d) and biases b, b̃; predicts ``w_i · w̃_j + b_i + b̃_j``
  for log X_ij. The reported vectors are w + w̃ (Pennington et al. 2014, section 4.2).

Evaluation (``WordVectors``, cosine similarity on unit vectors): nearest neighbours; analogies a:b :: c:?
by 3CosAdd, ``argmax_x cos(x, b - a + c)`` over words other than a, b, c (Mikolov et al. 2013c); Spearman
correlation between cosine similarities and human scores (WordSim-353, SimLex-999 style lists); word2vec
text format (``V d`` header, then ``word x_1 ... x_d`` per line) for gensim's ``load_word2vec_format``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.errors import InputError
from pretrain.io import atomic_write_text

BYTE_LEVEL_SPACE = "Ġ"  # byte-level BPE's mark of a leading space ("Ġking" is " king")


def word_tokenizer(words: Iterable[str], special_tokens: Sequence[str] | None = None):
    """A word-level ``tokenizers.Tokenizer`` (whitespace split): special tokens get ids 0.., then ``words``
    in order; unknown words map to ``<unk>``. For classic word vectors and toy tasks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, all_special_tokens

    specials = list(all_special_tokens() if special_tokens is None else special_tokens)
    vocab = {t: i for i, t in enumerate(dict.fromkeys([*specials, *words]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=DEFAULT_SPECIAL_TOKENS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    return tokenizer


class Word2Vec(nn.Module):
    """Skip-gram / CBOW scorer (see module doc)."""

    arch = "word2vec"

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        if vocab_size < 1 or dim < 1:
            raise ValueError(f"vocab_size and dim must be >= 1, got {vocab_size}, {dim}")
        self.center = nn.Embedding(vocab_size, dim)
        self.context = nn.Embedding(vocab_size, dim)
        nn.init.uniform_(self.center.weight, -0.5 / dim, 0.5 / dim)
        nn.init.zeros_(self.context.weight)

    def forward(
        self, input_ids: Tensor, input_mask: Tensor | None = None, candidates: Tensor | None = None
    ) -> Tensor:
        """``input_ids (N, C)``, ``input_mask (N, C)`` -> logits ``(N, K)`` for ``candidates (N, K)``, else ``(N, V)``."""
        v = self.center(input_ids)  # (N, C, d)
        if input_mask is None:
            h = v.mean(1)
        else:
            m = input_mask.to(v.dtype)[..., None]
            h = (v * m).sum(1) / m.sum(1).clamp_min(1)  # (N, d)
        if candidates is None:
            return h @ self.context.weight.T  # (N, V)
        return torch.einsum("nkd,nd->nk", self.context(candidates), h)

    def vectors(self) -> Tensor:
        """``(V, d)`` the center vectors (word2vec's output)."""
        return self.center.weight.detach()


class GloVeModel(nn.Module):
    """``w_i · w̃_j + b_i + b̃_j`` (see module doc); initialised U(-0.5/d, 0.5/d) as glove.c."""

    arch = "glove"

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        if vocab_size < 1 or dim < 1:
            raise ValueError(f"vocab_size and dim must be >= 1, got {vocab_size}, {dim}")
        self.word, self.context = nn.Embedding(vocab_size, dim), nn.Embedding(vocab_size, dim)
        self.word_bias, self.context_bias = nn.Embedding(vocab_size, 1), nn.Embedding(vocab_size, 1)
        for table in (self.word, self.context, self.word_bias, self.context_bias):
            nn.init.uniform_(table.weight, -0.5 / dim, 0.5 / dim)

    def forward(self, rows: Tensor, cols: Tensor) -> Tensor:
        """``rows, cols (N,)`` -> predicted log co-occurrence ``(N,)``."""
        dot = (self.word(rows) * self.context(cols)).sum(-1)
        return dot + self.word_bias(rows)[:, 0] + self.context_bias(cols)[:, 0]

    def vectors(self) -> Tensor:
        """``(V, d)``: w + w̃."""
        return (self.word.weight + self.context.weight).detach()


def rank(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of the (tie-averaged) ranks."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two equally long lists of >= 2 values, got {len(x)} and {len(y)}")
    return float(np.corrcoef(rank(np.asarray(x, float)), rank(np.asarray(y, float)))[0, 1])


class WordVectors:
    """Unit-normalised vectors ``(n, d)`` of ``words`` for queries; the raw vectors are kept for export."""

    def __init__(self, vectors: Tensor, words: Sequence[str]):
        if vectors.dim() != 2 or vectors.shape[0] != len(words):
            raise ValueError(f"need one vector per word: vectors {tuple(vectors.shape)}, {len(words)} words")
        if len(set(words)) != len(words):
            raise ValueError("words must be unique")
        if not words:
            raise ValueError("no words: the vocabulary is empty")
        self.raw = vectors.detach().float().cpu()
        self.unit = F.normalize(self.raw, dim=-1)
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def from_ids(cls, vectors: Tensor, tokenizer, ids: Iterable[int]) -> WordVectors:
        """Rows ``ids`` of a ``(V, d)`` table, named by the tokenizer's token strings."""
        ids = [int(i) for i in ids]
        return cls(vectors[ids], [tokenizer.id_to_token(i) for i in ids])

    def __len__(self) -> int:
        return len(self.words)

    def lookup(self, word: str) -> int | None:
        """Index of ``word``: the exact token, else its byte-level BPE form with a leading space."""
        return self.index.get(word, self.index.get(BYTE_LEVEL_SPACE + word))

    def _require(self, word: str) -> int:
        i = self.lookup(word)
        if i is None:
            raise KeyError(f"{word!r} is not in the vocabulary of {len(self)} words")
        return i

    def _top(self, query: Tensor, k: int, exclude: Iterable[int]) -> list[tuple[str, float]]:
        sims = self.unit @ F.normalize(query, dim=-1)  # (n,)
        sims[list(exclude)] = -float("inf")
        values, idx = sims.topk(min(k, len(self) - len(set(exclude))))
        return [(self.words[i], float(v)) for i, v in zip(idx.tolist(), values.tolist())]

    def nearest(self, word: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` words most cosine-similar to ``word`` (itself excluded)."""
        i = self._require(word)
        return self._top(self.unit[i], k, [i])

    def analogy(self, a: str, b: str, c: str, k: int = 1) -> list[tuple[str, float]]:
        """a : b :: c : ?  (3CosAdd; a, b and c are excluded from the answers)."""
        ia, ib, ic = (self._require(w) for w in (a, b, c))
        return self._top(self.unit[ib] - self.unit[ia] + self.unit[ic], k, [ia, ib, ic])

    def analogy_accuracy(self, questions: Iterable[Sequence[str]]) -> dict[str, float]:
        """Top-1 accuracy over ``(a, b, c, d)`` questions whose four words are all known (others are skipped)."""
        questions = list(questions)
        known = [q for q in questions if all(self.lookup(w) is not None for w in q)]
        correct = sum(self.analogy(a, b, c)[0][0] == self.words[self._require(d)] for a, b, c, d in known)
        return {
            "analogy_accuracy": correct / len(known) if known else float("nan"),
            "analogy_questions": len(known),
            "analogy_skipped": len(questions) - len(known),
        }

    def similarity(self, a: str, b: str) -> float:
        return float(self.unit[self._require(a)] @ self.unit[self._require(b)])

    def similarity_correlation(self, pairs: Iterable[tuple[str, str, float]]) -> dict[str, float]:
        """Spearman rho between cosine similarity and the given scores over pairs of known words."""
        pairs = list(pairs)
        known = [(a, b, s) for a, b, s in pairs if self.lookup(a) is not None and self.lookup(b) is not None]
        if len(known) < 2:
            raise InputError(f"only {len(known)} of {len(pairs)} word pairs are in the vocabulary; need >= 2")
        rho = spearman([self.similarity(a, b) for a, b, _ in known], [s for _, _, s in known])
        return {
            "similarity_spearman": rho,
            "similarity_pairs": len(known),
            "similarity_skipped": len(pairs) - len(known),
        }

    def save_word2vec(self, path: str | os.PathLike) -> Path:
        """Write the word2vec text format (``n d`` header, one ``word x_1 .. x_d`` line per word)."""
        bad = [w for w in self.words if not w or any(ch.isspace() for ch in w)]
        if bad:
            raise InputError(f"word2vec text format cannot hold words with whitespace: {bad[:5]}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (
            word + " " + " ".join(f"{x:.6g}" for x in vec) + "\n"
            for word, vec in zip(self.words, self.raw.numpy())
        )
        atomic_write_text(path, f"{len(self)} {self.raw.shape[1]}\n" + "".join(lines))
        return path

    @classmethod
    def load_word2vec(cls, path: str | os.PathLike) -> WordVectors:
        with open(path, encoding="utf-8") as f:
            n, d = map(int, f.readline().split())
            rows = [line.rstrip("\n").split(" ") for line in f if line.strip()]
        if len(rows) != n or any(len(r) != d + 1 for r in rows):
            raise InputError(f"{path}: header says {n} words of {d} dims but the lines disagree")
        return cls(torch.tensor([[float(x) for x in r[1:]] for r in rows]), [r[0] for r in rows])


def read_analogies(path: str | os.PathLike) -> list[tuple[str, str, str, str]]:
    """Questions ``a b c d`` one per line (Google ``questions-words.txt``: ``:`` section lines are skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith(":"):
            continue
        if len(parts) != 4:
            raise InputError(f"{path}:{n}: an analogy line needs 4 words 'a b c d', got {line!r}")
        a, b, c, d = parts
        out.append((a, b, c, d))
    return out


def read_similarity(path: str | os.PathLike) -> list[tuple[str, str, float]]:
    """``word1 word2 score`` per line (tabs or spaces; a header or comment line that does not parse is
    skipped, as in WordSim-353 / SimLex-999 files)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        parts = line.replace(",", " ").split()
        if len(parts) < 3 or line.lstrip().startswith("#"):
            continue
        try:
            out.append((parts[0], parts[1], float(parts[2])))
        except ValueError:
            continue
    if not out:
        raise InputError(f"{path}: no 'word1 word2 score' lines found")
    return out
