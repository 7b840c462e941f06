"""Skip-gram / CBOW objective: gradients against the closed forms, noise distribution, windows, subsampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS
from pretrain.models.word_vectors import Word2Vec, WordVectors, word_tokenizer
from pretrain.objectives.sgns import SkipGram, keep_probability, token_counts, vocabulary

SPECIALS = list(DEFAULT_SPECIAL_TOKENS.values())
EOS = SPECIALS.index("</s>")
N_SPECIAL = len(SPECIALS)


def make(n_words: int, stream: np.ndarray, **options) -> tuple[SkipGram, object]:
    tokenizer = word_tokenizer([f"w{i}" for i in range(n_words)], SPECIALS)
    counts = token_counts(stream, tokenizer.get_vocab_size())
    return SkipGram(tokenizer, counts=counts, **options), tokenizer


def zipf_stream(n_words: int, length: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_words + 1)
    return N_SPECIAL + rng.choice(n_words, size=length, p=p / p.sum())


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_full_softmax_center_gradient_is_observed_minus_expected():
    stream = zipf_stream(30, 400)
    objective, tokenizer = make(30, stream, window=3, min_count=1, subsample=0.0, full_softmax=True)
    batch = objective(torch.from_numpy(stream).view(4, 100), gens(4))
    torch.manual_seed(0)
    model = Word2Vec(tokenizer.get_vocab_size(), 8)
    torch.nn.init.normal_(model.context.weight)
    torch.nn.init.normal_(model.center.weight)
    logits = model(batch["input_ids"], batch["input_mask"])  # (N, V)
    loss_sum, n = objective.loss(logits, batch["labels"])
    assert n == batch["labels"].shape[0] > 100
    (-loss_sum).backward()  # gradient of the log-likelihood
    v, u = model.center.weight.detach(), model.context.weight.detach()
    centers, observed = batch["input_ids"][:, 0], batch["labels"]
    p = torch.softmax(v[centers] @ u.T, dim=-1)  # (N, V) = P(x | c)
    expected = torch.zeros_like(v).index_add_(0, centers, u[observed] - p @ u)  # u_o - sum_x P(x|c) u_x
    torch.testing.assert_close(model.center.weight.grad, expected, rtol=1e-4, atol=1e-5)


def test_negative_sampling_gradients_match_the_closed_form():
    stream = zipf_stream(30, 300, seed=1)
    objective, tokenizer = make(30, stream, window=2, negatives=4, min_count=1, subsample=0.0)
    batch = objective(torch.from_numpy(stream).view(3, 100), gens(3))
    torch.manual_seed(1)
    model = Word2Vec(tokenizer.get_vocab_size(), 6)
    torch.nn.init.normal_(model.context.weight)
    logits = model(batch["input_ids"], batch["input_mask"], batch["candidates"])  # (N, 1+k)
    assert logits.shape == (batch["input_ids"].shape[0], 5)
    loss_sum, _ = objective.loss(logits, batch["labels"])
    loss_sum.backward()
    v, u = model.center.weight.detach(), model.context.weight.detach()
    c, cand = batch["input_ids"][:, 0], batch["candidates"]
    s = torch.einsum("nkd,nd->nk", u[cand], v[c])
    coeff = torch.cat([-(1 - torch.sigmoid(s[:, :1])), torch.sigmoid(s[:, 1:])], dim=1)  # d loss / d s
    expected = torch.zeros_like(v).index_add_(0, c, torch.einsum("nk,nkd->nd", coeff, u[cand]))
    torch.testing.assert_close(model.center.weight.grad, expected, rtol=1e-4, atol=1e-6)


def test_noise_words_follow_unigram_to_the_three_quarters_within_3_sigma():
    stream = zipf_stream(20, 5000, seed=2)
    stream[::50] = EOS  # special tokens are never noise words
    objective, _ = make(20, stream, window=2, negatives=5, min_count=3, subsample=0.0)
    noise = objective(torch.from_numpy(stream).view(10, 500), gens(10))["candidates"][:, 1:].reshape(-1)
    counts = np.bincount(stream, minlength=N_SPECIAL + 20).astype(float)
    counts[:N_SPECIAL] = 0
    counts[counts < 3] = 0
    p = counts**0.75 / (counts**0.75).sum()
    observed = np.bincount(noise.numpy(), minlength=len(p))
    n = noise.numel()
    assert n > 20_000
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(observed - n * p) <= 3 * sigma + 1e-9), (observed, n * p)
    assert observed[:N_SPECIAL].sum() == 0


def test_pairs_lie_within_the_window_and_the_document():
    row = torch.arange(N_SPECIAL, N_SPECIAL + 40)  # token id = position + N_SPECIAL
    row[17] = EOS
    objective, _ = make(40, row.numpy(), window=1, min_count=1, subsample=0.0)
    batch = objective(row[None], gens(1))
    pairs = {
        (int(c) - N_SPECIAL, int(o) - N_SPECIAL)
        for c, o in zip(batch["input_ids"][:, 0], batch["candidates"][:, 0])
    }
    adjacent = {(i, j) for i in range(40) for j in (i - 1, i + 1) if 0 <= j < 40 and 17 not in (i, j)}
    assert pairs == adjacent  # window 1: exactly the neighbours; EOS separates documents

    objective, _ = make(40, row.numpy(), window=4, min_count=1, subsample=0.0)
    batch = objective(row[None].repeat(50, 1), gens(50))
    c, o = batch["input_ids"][:, 0] - N_SPECIAL, batch["candidates"][:, 0] - N_SPECIAL
    dist = (c - o).abs()
    assert dist.min() >= 1 and dist.max() == 4
    assert not ((c < 17) & (o > 17)).any() and not ((c > 17) & (o < 17)).any()
    # dynamic window b ~ U{1..m}: an ordered pair at distance d is used with probability (m - d + 1) / m
    freq = torch.bincount(dist, minlength=5)[1:].double()
    pairs_at = torch.tensor(
        [50 * sum(2 * (n - d) for n in (17, 22)) for d in range(1, 5)], dtype=torch.float64
    )
    q = torch.tensor([1.0, 0.75, 0.5, 0.25], dtype=torch.float64)
    assert ((freq - pairs_at * q).abs() <= 4 * (pairs_at * q * (1 - q)).sqrt() + 1e-9).all(), (
        freq,
        pairs_at * q,
    )


def test_cbow_inputs_are_the_context_window_of_the_target():
    row = torch.arange(N_SPECIAL, N_SPECIAL + 30)
    objective, _ = make(30, row.numpy(), window=2, min_count=1, subsample=0.0, cbow=True)
    batch = objective(row[None], gens(1))
    target = batch["candidates"][:, 0]
    assert batch["input_ids"].shape == (30, 4) and batch["input_mask"].any(1).all()
    dist = (batch["input_ids"] - target[:, None]).abs()
    assert ((dist >= 1) & (dist <= 2))[batch["input_mask"]].all()


def test_subsampling_keeps_frequent_words_with_word2vec_probability():
    counts = torch.tensor([0, 0, 1000, 10, 990])
    vocab = torch.tensor([False, False, True, True, True])
    keep = keep_probability(counts, vocab, 1e-2)
    f = torch.tensor([0.5, 0.005, 0.495], dtype=torch.float64)
    expected = ((f / 1e-2).sqrt() + 1) * 1e-2 / f
    torch.testing.assert_close(keep[2:].double(), expected.clamp(max=1), rtol=1e-5, atol=0)
    assert keep[3] == 1.0 and keep[:2].eq(0).all()

    stream = zipf_stream(10, 4000, seed=3)
    objective, _ = make(10, stream, window=1, min_count=1, subsample=1e-2)
    batch = objective(torch.from_numpy(stream).view(8, 500), gens(8))
    kept_first = (batch["input_ids"][:, 0] == N_SPECIAL).sum() / 2  # word 0 is kept as center ~2x (window 1)
    n0 = (stream == N_SPECIAL).sum()
    p = float(objective.keep[N_SPECIAL])
    assert abs(float(kept_first) - n0 * p) < 4 * np.sqrt(n0 * p * (1 - p)) + 5


def test_same_generators_same_examples_and_rows_are_independent():
    stream = zipf_stream(15, 200, seed=4)
    objective, _ = make(15, stream, min_count=1)
    tokens = torch.from_numpy(stream).view(2, 100)
    a, b = objective(tokens, gens(2)), objective(tokens, gens(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = objective(tokens[:1], gens(1))
    n = first["input_ids"].shape[0]
    assert all(torch.equal(first[k], a[k][:n]) for k in a)


def test_bad_options_are_clear_errors():
    stream = zipf_stream(10, 100)
    with pytest.raises(ValueError, match=r"window \(context words on each side\) must be an integer >= 1"):
        make(10, stream, window=0)
    with pytest.raises(ValueError, match=r"negatives \(k noise words per example\) must be an integer >= 1"):
        make(10, stream, negatives=0)
    with pytest.raises(ValueError, match="vocabulary is empty after min-count filtering.*lower min_count"):
        make(10, stream, min_count=10_000)
    tokenizer = word_tokenizer(["a"], SPECIALS)
    with pytest.raises(ValueError, match="one count per token id"):
        SkipGram(tokenizer, counts=[1, 2, 3])
    with pytest.raises(ValueError, match="min_count must be an integer >= 1"):
        vocabulary(torch.ones(3, dtype=torch.long), 0, torch.zeros(3, dtype=torch.bool))


def test_sgns_learns_topics_from_cooccurrence():
    """Sentences draw words from one of two topics; after training, neighbours share the topic."""
    rng = np.random.default_rng(5)
    topics = rng.integers(0, 2, size=400)
    stream = np.concatenate(
        [np.append(N_SPECIAL + 10 * t + rng.integers(0, 10, size=9), EOS) for t in topics]
    )
    objective, tokenizer = make(20, stream, window=3, negatives=5, min_count=1, subsample=0.0)
    torch.manual_seed(0)
    model = Word2Vec(tokenizer.get_vocab_size(), 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    tokens = torch.from_numpy(stream[: len(stream) // 100 * 100]).view(-1, 100)
    for step in range(40):
        batch = objective(tokens[step % 5 :: 5], gens(8, seed=100 * step))
        loss_sum, n = objective.loss(
            model(batch["input_ids"], batch["input_mask"], batch["candidates"]), batch["labels"]
        )
        opt.zero_grad()
        (loss_sum / n).backward()
        opt.step()
    wv = WordVectors.from_ids(model.vectors(), tokenizer, range(N_SPECIAL, N_SPECIAL + 20))
    same_topic = [int(w[1:]) // 10 == i // 10 for i in range(20) for w, _ in wv.nearest(f"w{i}", k=3)]
    assert np.mean(same_topic) > 0.95
