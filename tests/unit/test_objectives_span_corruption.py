"""T5 span corruption (objectives/span_corruption.py) against T5's algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_data import packed_batch, rebuild, sentinel_set, tiny_tokenizer

from pretrain import objectives


def t5_random_spans_helper(inputs_length, noise_density, mean_noise_span_length):
    """Straight port of T5's random_spans_helper (one sentinel per span in inputs and targets):
    (tokens_length, inputs_length, targets_length)."""

    def lengths(tokens_length):
        num_noise_tokens = round(tokens_length * noise_density)
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = round(num_noise_tokens / mean_noise_span_length)
        return num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, lengths(tokens_length)[0], targets_length


def t5_noise_mask(length, noise_density, mean_noise_span_length, rng):
    """Straight NumPy port of T5's random_spans_noise_mask (shuffle-based random segmentation)."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span_length), 1)

    def segmentation(num_items, num_segments):
        first_in_segment = np.arange(num_items - 1) < num_segments - 1
        rng.shuffle(first_in_segment)
        segment_id = np.cumsum(np.concatenate([[0], first_in_segment]))
        return np.bincount(segment_id)

    interleaved = np.stack(
        [segmentation(length - num_noise, num_spans), segmentation(num_noise, num_spans)], 1
    )
    starts = np.cumsum(interleaved.reshape(-1))[:-1]
    indicator = np.zeros(length, dtype=int)
    indicator[starts] = 1
    return np.cumsum(indicator) % 2 == 1


@pytest.mark.parametrize(
    ("inputs_length", "density", "mean_span"),
    [(512, 0.15, 3.0), (128, 0.15, 3.0), (1024, 0.15, 3.0), (568, 0.15, 3.0), (256, 0.15, 8.0),
     (512, 0.5, 3.0), (512, 0.5, 8.0), (114, 0.3, 2.0), (512, 0.15, 64.0), (33, 0.1, 1.0)],
)  # fmt: skip
def test_lengths_equal_t5(inputs_length, density, mean_span):
    tok = tiny_tokenizer(num_sentinels=200)  # density 0.5, mean span 3 needs 128 sentinels at 512
    obj = objectives.build("span_corruption", tok, noise_density=density, mean_noise_span_length=mean_span)
    tokens_length, t5_inputs, t5_targets = t5_random_spans_helper(inputs_length, density, mean_span)
    assert obj.raw_length(inputs_length) == tokens_length
    out = obj(packed_batch(2, tokens_length, num_sentinels=200), torch.Generator().manual_seed(0))
    assert out["input_ids"].shape == (2, t5_inputs) and out["labels"].shape == (2, t5_targets)
    assert t5_inputs == inputs_length or (density == 0.5 and t5_inputs <= inputs_length)


def test_at_least_one_span_where_t5_helper_counts_none():
    """T5's helper counts round(9 / 64) = 0 spans for input 64 at mean span 64, but its noise mask always
    has one, so T5's inputs would be 65 long; here the raw length is one less and the inputs fill 64."""
    obj = objectives.build("span_corruption", tiny_tokenizer(), mean_noise_span_length=64.0)
    assert t5_random_spans_helper(64, 0.15, 64.0)[0] == 74
    assert obj.raw_length(64) == 73
    assert obj(packed_batch(2, 73), torch.Generator())["input_ids"].shape == (2, 64)


def test_reference_lengths():
    obj = objectives.build("span_corruption", tiny_tokenizer())
    assert (obj.raw_length(512), obj.raw_length(128)) == (568, 141)
    out = obj(packed_batch(2, 568), torch.Generator())
    assert out["input_ids"].shape == (2, 512) and out["labels"].shape == (2, 114)


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(2, 300),
    density=st.sampled_from([0.05, 0.15, 0.3, 0.5, 0.8]),
    mean_span=st.sampled_from([1.0, 3.0, 8.0]),
    seed=st.integers(0, 2**32),
)
def test_original_is_rebuilt_from_inputs_and_targets(length, density, mean_span, seed):
    tok = tiny_tokenizer(num_sentinels=200)
    obj = objectives.build("span_corruption", tok, noise_density=density, mean_noise_span_length=mean_span)
    raw = packed_batch(3, length, seed=seed % 997, num_sentinels=200)
    out = obj(raw, torch.Generator().manual_seed(seed))
    sentinels, eos, pad = sentinel_set(tok), tok.token_to_id("</s>"), tok.token_to_id("<pad>")
    for row, inputs, targets in zip(raw.tolist(), out["input_ids"].tolist(), out["labels"].tolist()):
        assert inputs[-1] == eos and targets[-1] == eos
        assert rebuild(inputs, targets, sentinels) == row
        used = [sentinels[t] for t in inputs if t in sentinels]
        assert used == list(range(len(used))) == [sentinels[t] for t in targets if t in sentinels]
        assert targets[0] in sentinels and len(used) >= 1
    assert torch.equal(out["decoder_input_ids"][:, 1:], out["labels"][:, :-1])
    assert (out["decoder_input_ids"][:, 0] == pad).all()


def test_short_sequences_never_crash():
    obj = objectives.build("span_corruption", tiny_tokenizer())
    for length in range(2, 11):
        out = obj(packed_batch(4, length, seed=length), torch.Generator().manual_seed(length))
        assert out["input_ids"].shape[1] + out["labels"].shape[1] == length + 2 * 1 + 2  # 1 span, 2 EOS
    with pytest.raises(ValueError, match="at least 2 raw tokens"):
        obj(packed_batch(2, 1), torch.Generator())
    with pytest.raises(ValueError, match="input length >= 3"):
        obj.raw_length(2)


def span_lengths(mask: np.ndarray) -> np.ndarray:
    """Lengths of the runs of True of a 2-D bool array, all rows together."""
    padded = np.pad(mask.astype(int), ((0, 0), (1, 1)))
    edges = np.diff(padded, axis=1)
    return np.nonzero(edges == -1)[1] - np.nonzero(edges == 1)[1]


def test_noise_statistics_match_t5():
    """Density and mean span length, and the span-length distribution and noise position profile are
    those of a NumPy port of T5's algorithm (two-sample, within 3 sigma)."""
    from pretrain.objectives.span_corruption import random_spans_noise_mask

    B, L, density, mean_span = 4000, 100, 0.15, 3.0
    ours = random_spans_noise_mask(
        L, density, mean_span, [torch.Generator().manual_seed(i) for i in range(B)]
    ).numpy()
    rng = np.random.default_rng(0)
    reference = np.stack([t5_noise_mask(L, density, mean_span, rng) for _ in range(B)])

    for mask in (ours, reference):
        lengths = span_lengths(mask)
        assert mask.sum() == B * round(L * density)  # T5: the number of noise tokens is fixed
        assert len(lengths) == B * round(round(L * density) / mean_span)
        assert abs(lengths.mean() - round(L * density) / round(L * density / mean_span)) < 1e-9
    for k in (1, 2, 3, 5):
        p_ours, p_ref = (np.mean(span_lengths(m) == k) for m in (ours, reference))
        n = len(span_lengths(ours))
        sigma = math.sqrt(2 * p_ref * (1 - p_ref) / n)
        assert abs(p_ours - p_ref) <= 3 * sigma + 1e-12, (k, p_ours, p_ref)
    for position in (0, 10, 50, 90, 99):  # T5's mask is not uniform over positions (it always ends noisy)
        p_ours, p_ref = ours[:, position].mean(), reference[:, position].mean()
        sigma = math.sqrt(2 * max(p_ref * (1 - p_ref), 1e-4) / B)
        assert abs(p_ours - p_ref) <= 3 * sigma, (position, p_ours, p_ref)


def test_too_few_sentinels_fail_at_set_up():
    tok = tiny_tokenizer(num_sentinels=5)
    obj = objectives.build("span_corruption", tok)
    assert obj.raw_length(64) == 70  # 4 spans
    with pytest.raises(
        ValueError, match=r"only 5 sentinel tokens but 28 are needed \(missing '<extra_id_5>'\)"
    ):
        obj.raw_length(512)
    with pytest.raises(ValueError, match="only 5 sentinel tokens"):
        obj(packed_batch(1, 568), torch.Generator())
    with pytest.raises(ValueError, match="only 0 sentinel tokens"):
        objectives.build("span_corruption", tiny_tokenizer(num_sentinels=0))


def test_bad_options_fail_at_set_up():
    with pytest.raises(ValueError, match="noise_density"):
        objectives.build("span_corruption", tiny_tokenizer(), noise_density=0.0)
    with pytest.raises(ValueError, match="mean_noise_span_length"):
        objectives.build("span_corruption", tiny_tokenizer(), mean_noise_span_length=0.5)
