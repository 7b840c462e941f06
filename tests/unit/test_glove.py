"""GloVe: the published weighting, co-occurrence counts against a brute-force count, training, planted analogies."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch

from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS
from pretrain.models.word_vectors import GloVeModel, WordVectors, word_tokenizer
from pretrain.objectives.glove import GloVe, cooccurrence, glove_weight

SPECIALS = list(DEFAULT_SPECIAL_TOKENS.values())
EOS = SPECIALS.index("</s>")
N_SPECIAL = len(SPECIALS)


def test_weighting_function_is_the_published_one():
    x = torch.tensor([0.5, 1.0, 10.0, 50.0, 99.999, 100.0, 100.001, 1e6], dtype=torch.float64)
    expected = torch.tensor(
        [(v / 100.0) ** 0.75 if v < 100 else 1.0 for v in x.tolist()], dtype=torch.float64
    )
    assert torch.equal(glove_weight(x), expected)
    assert glove_weight(torch.tensor([8.0]), x_max=10.0, alpha=0.5).item() == pytest.approx(0.8**0.5)
    assert GloVe(word_tokenizer(["a"], SPECIALS)).weight(torch.tensor([200.0])).item() == 1.0


def brute_force(
    stream: list[int], vocab: set[int], window: int, symmetric: bool
) -> dict[tuple[int, int], float]:
    """glove's cooccur.c, written as the plain loop: OOV tokens vanish, EOS resets the window."""
    counts: dict[tuple[int, int], float] = defaultdict(float)
    history: list[int] = []
    for tok in stream:
        if tok == EOS:
            history = []
            continue
        if tok not in vocab:
            continue
        for dist, left in enumerate(reversed(history[-window:]), start=1):
            counts[(left, tok)] += 1.0 / dist
            if symmetric:
                counts[(tok, left)] += 1.0 / dist
        history.append(tok)
    return counts


@pytest.mark.parametrize("symmetric", [True, False])
def test_cooccurrence_matches_the_reference_loop_across_chunks(symmetric):
    rng = np.random.default_rng(0)
    stream = N_SPECIAL + rng.integers(0, 25, size=3000)
    stream[rng.random(3000) < 0.05] = EOS
    tokenizer = word_tokenizer([f"w{i}" for i in range(25)], SPECIALS)
    glove = GloVe(tokenizer, window=4, min_count=110, symmetric=symmetric)
    counts = np.bincount(stream, minlength=N_SPECIAL + 25)
    vocab = {i for i in range(N_SPECIAL, N_SPECIAL + 25) if counts[i] >= 110}
    assert 0 < len(vocab) < 25  # some words fall below min_count
    reference = brute_force(stream.tolist(), vocab, 4, symmetric)
    x = glove.count(stream)
    got = {(int(r), int(c)): float(v) for r, c, v in zip(x.rows, x.cols, x.values)}
    assert got.keys() == reference.keys()
    assert all(abs(got[k] - reference[k]) < 1e-4 for k in got)
    special = glove.special
    chunked = cooccurrence(stream, x.vocab, special, 4, symmetric, chunk=97)  # pairs straddle chunk edges
    torch.testing.assert_close(chunked.dense(), x.dense())


def planted_corpus(seed: int, k_pairs: int = 20, n_other: int = 20) -> tuple[np.ndarray, list[str]]:
    """Latent vectors z: targets t{a}{g} = 0.8 (e_a + e_{4+g}) (4 attributes x 2 genders, so t0m - t0f + t1f = t1m),
    and n_other random words. Every pair (i, j) is written ``round(k_pairs exp(z_i . z_j))`` times as a sentence
    ``w_i w_j </s>``, so log X_ij = log k_pairs + z_i . z_j: the GloVe model holds with a planted analogy."""
    eye = np.eye(6)
    z = [0.8 * (eye[a] + eye[4 + g]) for a in range(4) for g in range(2)]
    z = np.array(z + list(np.random.default_rng(seed).normal(scale=0.5, size=(n_other, 6))))
    words = [f"t{a}{g}" for a in range(4) for g in "mf"] + [f"o{i}" for i in range(n_other)]
    i, j = np.triu_indices(len(z), 1)
    reps = np.rint(k_pairs * np.exp(z @ z.T)).astype(int)[i, j]
    pairs = N_SPECIAL + np.stack([np.repeat(i, reps), np.repeat(j, reps)], 1)
    return np.concatenate([pairs, np.full((len(pairs), 1), EOS)], 1).reshape(-1), words


def train_glove(
    glove: GloVe, stream: np.ndarray, vocab_size: int, dim: int, steps: int
) -> tuple[GloVeModel, list]:
    x = glove.count(stream)
    torch.manual_seed(0)
    model = GloVeModel(vocab_size, dim)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    losses = []
    for _ in range(steps):
        loss_sum, n = glove.loss(model(x.rows, x.cols), x.values)
        opt.zero_grad()
        (loss_sum / n).backward()
        opt.step()
        losses.append(float(loss_sum.detach() / n))
    return model, losses


def test_loss_is_the_weighted_least_squares_and_decreases():
    stream, words = planted_corpus(1)
    tokenizer = word_tokenizer(words, SPECIALS)
    glove = GloVe(tokenizer, window=3, min_count=1, x_max=10.0)
    x = glove.count(stream)
    pred = torch.randn(x.values.shape)
    loss_sum, n = glove.loss(pred, x.values)
    f = torch.where(x.values < 10, (x.values / 10) ** 0.75, 1.0)
    torch.testing.assert_close(loss_sum, (f * (pred - x.values.log()) ** 2).sum())
    assert n == x.values.numel()
    _, losses = train_glove(glove, stream, tokenizer.get_vocab_size(), 8, 60)
    assert losses[-1] < 0.2 * losses[0]
    assert all(b <= a * 1.05 for a, b in itertools.pairwise(losses))


def test_planted_analogy_is_recovered():
    stream, words = planted_corpus(2)
    tokenizer = word_tokenizer(words, SPECIALS)
    glove = GloVe(tokenizer, window=2, min_count=1)
    questions = [(f"t{a}m", f"t{a}f", f"t{b}m", f"t{b}f") for a in range(4) for b in range(4) if a != b]
    questions += [(f"t{a}m", f"t{b}m", f"t{a}f", f"t{b}f") for a in range(4) for b in range(4) if a != b]
    ids = range(N_SPECIAL, N_SPECIAL + len(words))
    untrained = WordVectors.from_ids(GloVeModel(tokenizer.get_vocab_size(), 8).vectors(), tokenizer, ids)
    assert untrained.analogy_accuracy(questions)["analogy_accuracy"] < 0.5  # the check can fail
    model, _ = train_glove(glove, stream, tokenizer.get_vocab_size(), 8, 300)
    wv = WordVectors.from_ids(model.vectors(), tokenizer, ids)
    result = wv.analogy_accuracy(questions)
    assert result == {"analogy_accuracy": 1.0, "analogy_questions": 24, "analogy_skipped": 0}
    assert wv.analogy("t0m", "t0f", "t1m")[0][0] == "t1f"


def test_bad_input_is_a_clear_error():
    tokenizer = word_tokenizer(["a", "b"], SPECIALS)
    with pytest.raises(ValueError, match=r"window \(context words on each side\) must be an integer >= 1"):
        GloVe(tokenizer, window=0)
    with pytest.raises(ValueError, match="min_count must be an integer >= 1"):
        GloVe(tokenizer, min_count=0)
    stream = np.array([N_SPECIAL, N_SPECIAL + 1, EOS] * 3)
    with pytest.raises(ValueError, match="vocabulary is empty after min-count filtering"):
        GloVe(tokenizer, min_count=5).count(stream)
