"""Prefix LM (objectives/prefix_lm.py) for decoder-only and encoder-decoder models."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_data import packed_batch, tiny_model, tiny_tokenizer

from pretrain import objectives
from pretrain.objectives.loss import IGNORE_INDEX


@settings(max_examples=40, deadline=None)
@given(length=st.integers(2, 200), seed=st.integers(0, 2**32))
def test_decoder_predicts_only_the_suffix(length, seed):
    obj = objectives.build("prefix_lm", tiny_tokenizer())
    raw = packed_batch(4, obj.raw_length(length), seed=seed % 991)
    out = obj(raw, torch.Generator().manual_seed(seed))
    p = out["prefix_lengths"]
    assert ((p >= 1) & (p <= length - 1)).all()
    assert torch.equal(out["input_ids"], raw[:, :-1])
    positions = torch.arange(length)
    # the prediction at input position t is token t+1: targets are exactly the tokens after the prefix
    assert torch.equal(out["labels"] == IGNORE_INDEX, positions < p[:, None] - 1)
    kept = out["labels"] != IGNORE_INDEX
    assert torch.equal(out["labels"][kept], raw[:, 1:][kept])


def test_split_point_is_uniform():
    obj = objectives.build("prefix_lm", tiny_tokenizer())
    T, B = 20, 8000
    tokens = torch.zeros(B, obj.raw_length(T), dtype=torch.long)
    p = obj(tokens, torch.Generator().manual_seed(0))["prefix_lengths"]
    counts = torch.bincount(p, minlength=T)[1:T]  # U{1, T-1}
    expected = B / (T - 1)
    assert counts.min() > 0 and p.max() <= T - 1
    assert ((counts - expected).abs() <= 4 * math.sqrt(expected)).all()


def test_targets_do_not_see_the_suffix():
    """With the backbone (or its stand-in): logits at prefix positions ignore every suffix token, so the
    first target (token p, predicted at position p-1) does not leak; the prefix is bidirectional."""
    tok = tiny_tokenizer()
    obj = objectives.build("prefix_lm", tok)
    model, logits_of = tiny_model("decoder", tok.get_vocab_size())
    batch = obj(packed_batch(4, obj.raw_length(32), seed=2), torch.Generator().manual_seed(5))
    batch.pop("labels")
    p = batch["prefix_lengths"]
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    suffix = torch.arange(32) >= p[:, None]
    changed["input_ids"][suffix] = (changed["input_ids"][suffix] + 1) % 900 + 100
    with torch.no_grad():
        before, after = logits_of(model, **batch), logits_of(model, **changed)
        for b in range(4):
            torch.testing.assert_close(before[b, : p[b]], after[b, : p[b]])
            assert not torch.allclose(before[b, p[b] :], after[b, p[b] :])
        if (p >= 2).any():  # bidirectional: the first position sees the last prefix token
            b = int((p >= 2).nonzero()[0])
            last = dict(batch, input_ids=batch["input_ids"].clone())
            last["input_ids"][b, p[b] - 1] = (last["input_ids"][b, p[b] - 1] + 1) % 900 + 100
            assert not torch.allclose(logits_of(model, **last)[b, 0], before[b, 0])


@settings(max_examples=40, deadline=None)
@given(length=st.integers(2, 150), seed=st.integers(0, 2**32))
def test_encoder_decoder_splits_prefix_and_target(length, seed):
    tok = tiny_tokenizer()
    eos, pad = tok.token_to_id("</s>"), tok.token_to_id("<pad>")
    obj = objectives.build("prefix_lm", tok, arch="encoder-decoder")
    raw = packed_batch(4, obj.raw_length(length), seed=seed % 991)
    out = obj(raw, torch.Generator().manual_seed(seed))
    assert out["input_ids"].shape == (4, length) and out["labels"].shape == (4, length + 1)
    for row, inputs, mask, labels, dec_mask in zip(
        raw.tolist(),
        *(out[k].tolist() for k in ("input_ids", "attention_mask", "labels", "decoder_attention_mask")),
    ):
        n_in, n_out = sum(mask), sum(t != IGNORE_INDEX for t in labels)
        assert n_in >= 1 and n_out >= 2 and mask == [1] * n_in + [0] * (length - n_in)
        assert inputs[n_in:] == [pad] * (length - n_in)
        assert inputs[:n_in] + labels[: n_out - 1] == row and labels[n_out - 1] == eos
        n_pad = length + 1 - n_out
        assert labels[n_out:] == [IGNORE_INDEX] * n_pad and dec_mask == [1] * n_out + [0] * n_pad
    assert (out["decoder_input_ids"][:, 0] == pad).all()
    shifted = out["labels"][:, :-1].masked_fill(out["labels"][:, :-1] == IGNORE_INDEX, pad)
    assert torch.equal(out["decoder_input_ids"][:, 1:], shifted)
