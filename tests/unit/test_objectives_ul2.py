"""UL2 mixture of denoisers (objectives/ul2.py)."""

from __future__ import annotations

import math

import pytest
import torch
from objective_data import packed_batch, rebuild, sentinel_set, tiny_tokenizer

from pretrain import objectives
from pretrain.datamodules.special_tokens import UL2_MODE_TOKENS
from pretrain.objectives.loss import IGNORE_INDEX
from pretrain.objectives.ul2 import DEFAULT_DENOISERS


def decode_example(tok, obj, raw: list[int], inputs: list[int], mask: list[int], labels: list[int]) -> str:
    """Check one example is a valid denoising of a raw prefix; return its mode (R, S or X)."""
    mode = {tok.token_to_id(t): m for m, t in UL2_MODE_TOKENS.items()}[inputs[0]]
    n_in, n_out = sum(mask), sum(t != IGNORE_INDEX for t in labels)
    pad, eos = tok.token_to_id("<pad>"), tok.token_to_id("</s>")
    assert mask == [1] * n_in + [0] * (len(mask) - n_in) and inputs[n_in:] == [pad] * (len(mask) - n_in)
    assert labels[n_out:] == [IGNORE_INDEX] * (len(labels) - n_out) and labels[n_out - 1] == eos
    if mode == "S":
        original = inputs[1:n_in] + labels[: n_out - 1]
        assert n_in >= 2 and n_out >= 2
    else:
        original = rebuild(inputs[1:n_in], labels[:n_out], sentinel_set(tok))
    lengths = {n for d, n in zip(obj.denoisers, obj.lengths) if d["mode"] == mode}
    assert len(original) in lengths and original == raw[: len(original)]
    return mode


def test_every_example_is_a_denoising_of_its_sample_with_its_mode_token():
    tok = tiny_tokenizer()
    obj = objectives.build("ul2", tok, input_length=96, target_length=80)
    raw = packed_batch(300, obj.raw_length(96), seed=1)
    out = obj(raw, torch.Generator().manual_seed(0))
    assert out["input_ids"].shape == (300, 96) and out["labels"].shape == (300, 80)
    assert torch.equal(out["decoder_attention_mask"], (out["labels"] != IGNORE_INDEX).long())
    modes = [
        decode_example(tok, obj, r, i, m, lab)
        for r, i, m, lab in zip(
            *(t.tolist() for t in (raw, out["input_ids"], out["attention_mask"], out["labels"]))
        )
    ]
    assert set(modes) == {"R", "S", "X"}


def test_denoisers_are_sampled_by_weight():
    tok = tiny_tokenizer()
    weights = {"R": 1.0, "S": 3.0, "X": 0.0}
    denoisers = [dict(d, weight=weights[d["mode"]]) for d in DEFAULT_DENOISERS]
    obj = objectives.build("ul2", tok, input_length=32, denoisers=denoisers)
    B = 4000
    first = obj(packed_batch(B, obj.raw_length(32)), torch.Generator().manual_seed(3))["input_ids"][:, 0]
    total = sum(weights[d["mode"]] for d in DEFAULT_DENOISERS)
    for mode, token in UL2_MODE_TOKENS.items():
        p = sum(weights[d["mode"]] for d in DEFAULT_DENOISERS if d["mode"] == mode) / total
        count = (first == tok.token_to_id(token)).sum().item()
        assert abs(count - B * p) <= 3 * math.sqrt(B * p * (1 - p)) + 1e-9, (mode, count, B * p)


def test_extreme_denoiser_noise_density():
    tok = tiny_tokenizer()
    obj = objectives.build(
        "ul2",
        tok,
        input_length=128,
        denoisers=[{"mode": "X", "noise_density": 0.5, "mean_noise_span_length": 8.0}],
    )
    out = obj(packed_batch(50, obj.raw_length(128)), torch.Generator().manual_seed(0))
    sentinels = torch.tensor(list(sentinel_set(tok)))
    targets = out["labels"][0]
    n_noise = (~torch.isin(targets, sentinels) & (targets != IGNORE_INDEX)).sum().item() - 1  # minus EOS
    assert n_noise == round(obj.lengths[0] * 0.5)
    assert round(n_noise / torch.isin(targets, sentinels).sum().item()) == 8


def test_default_mixture_needs_more_sentinels_at_512():
    # X (mean span 3, density 0.5) on 511 input slots (+ mode token): 765 raw tokens, 382 noise, 127 spans
    with pytest.raises(ValueError, match=r"only 100 sentinel tokens but 127 are needed"):
        objectives.build("ul2", tiny_tokenizer(), input_length=512)
    obj = objectives.build("ul2", tiny_tokenizer(num_sentinels=200), input_length=512)
    assert obj.raw_length(512) == max(obj.lengths) > 568


def test_bad_set_up_is_named():
    with pytest.raises(ValueError, match=r"no UL2 mode token '\[S2S\]'"):
        objectives.build("ul2", tiny_tokenizer(without=("[S2S]",)), input_length=64)
    with pytest.raises(ValueError, match="'mode' must be one of"):
        objectives.build("ul2", tiny_tokenizer(), input_length=64, denoisers=[{"mode": "Q"}])
    with pytest.raises(ValueError, match="takes no span options"):
        objectives.build(
            "ul2", tiny_tokenizer(), input_length=64, denoisers=[{"mode": "S", "noise_density": 0.5}]
        )
    with pytest.raises(ValueError, match="too short"):
        objectives.build("ul2", tiny_tokenizer(), input_length=2)
    obj = objectives.build("ul2", tiny_tokenizer(), input_length=64)
    with pytest.raises(ValueError, match="built for input_length=64"):
        obj.raw_length(128)
    with pytest.raises(ValueError, match="raw tokens per sample"):
        obj(packed_batch(2, 10), torch.Generator())
