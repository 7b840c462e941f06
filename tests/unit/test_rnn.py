"""Recurrent models: gate initialisation, state carry (TBPTT), attention scores, masking, decoding via the shared
generate / beam search."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.beam_search import beam_search
from pretrain.models.generation import generate
from pretrain.models.rnn import (
    AttentionScore,
    RNNConfig,
    RNNLanguageModel,
    RNNState,
    Seq2SeqConfig,
    Seq2SeqRNN,
    matched_width,
)
from pretrain.objectives.loss import token_cross_entropy

PAD, BOS, EOS = 0, 1, 2


def lm(**kw) -> RNNLanguageModel:
    torch.manual_seed(0)
    return RNNLanguageModel(
        RNNConfig(**{"vocab_size": 50, "d_embed": 16, "d_hidden": 16, "n_layer": 2, **kw})
    )


def s2s(**kw) -> Seq2SeqRNN:
    torch.manual_seed(0)
    cfg = {
        "vocab_size": 20,
        "d_embed": 16,
        "d_hidden": 16,
        "dropout": 0.0,
        "attention_rank": 4,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,
        **kw,
    }
    return Seq2SeqRNN(Seq2SeqConfig(**cfg)).eval()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_forget_gate_bias_is_the_gate_that_keeps_the_past(cell):
    """Zero every weight: then an LSTM's cell state decays by sigmoid(b_f) per step, a GRU's hidden state by
    sigmoid(b_z) -- only if ``forget_bias`` landed on that gate."""
    model = lm(cell=cell, n_layer=1, forget_bias=1.5)
    rnn = model.rnn
    H = rnn.hidden_size
    assert rnn.bias_ih_l0[H : 2 * H].eq(1.5).all() and rnn.bias_hh_l0[H : 2 * H].eq(0).all()
    with torch.no_grad():
        for name, p in rnn.named_parameters():
            if name.startswith("weight"):
                p.zero_()
            else:
                p[:H] = 0
                p[2 * H :] = 0
    h0 = torch.ones(1, 1, H)
    x = torch.randn(1, 1, 16)
    if cell == "lstm":
        _, (_, c) = rnn(x, (torch.zeros(1, 1, H), h0))
        expected = torch.sigmoid(torch.tensor(1.5))  # c' = f c + i g, g = tanh(0) = 0
        torch.testing.assert_close(c, h0 * expected)
    else:
        _, h = rnn(x, h0)
        z = torch.sigmoid(torch.tensor(1.5))  # h' = (1 - z) tanh(0) + z h
        torch.testing.assert_close(h, h0 * z)


def test_tied_embeddings_and_projection():
    model = lm(d_hidden=24)
    assert model.head.weight is model.embed.weight and model.proj.weight.shape == (16, 24)
    untied = lm(tie_embeddings=False, d_hidden=24)
    assert untied.proj is None and untied.head.weight.shape == (50, 24)
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.num_params() < untied.num_params()
    assert model.num_params(exclude_embeddings=True) == model.num_params() - 50 * 16


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_carried_state_equals_one_long_sequence(cell):
    model = lm(cell=cell).eval()
    x = torch.randint(0, 50, (3, 20))
    whole = model(x).logits
    first = model(x[:, :12])
    second = model(x[:, 12:], cache=first.cache)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, rtol=1e-5, atol=1e-5)


def test_detached_state_stops_gradients_at_the_batch_boundary():
    model = lm().eval()
    x = torch.randint(0, 50, (2, 10))
    weight = model.rnn.weight_hh_l0
    first = model(x[:, :5])
    fresh = RNNState(
        first.cache.h.detach().clone(), first.cache.c.detach().clone()
    )  # same values, no history
    (g_fresh,) = torch.autograd.grad(model(x[:, 5:], cache=fresh).logits.sum(), weight)
    (g_cut,) = torch.autograd.grad(model(x[:, 5:], cache=first.cache.detach()).logits.sum(), weight)
    (g_full,) = torch.autograd.grad(model(x[:, 5:], cache=first.cache).logits.sum(), weight)
    torch.testing.assert_close(g_cut, g_fresh)
    assert not torch.allclose(g_full, g_cut)  # without the cut, gradients flow into the first chunk


def test_padding_is_rejected_by_the_language_model():
    with pytest.raises(ValueError, match="attention_mask must be all 1"):
        lm()(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]))


def test_greedy_generate_with_the_cache_equals_recomputing_from_scratch():
    model = lm().eval()
    prompt = torch.randint(3, 50, (2, 4))
    out = generate(model, prompt, 6, greedy=True, eos_token_id=None)
    tokens = prompt
    for _ in range(6):
        tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, tokens)


def test_low_rank_is_multiplicative_with_w_equal_u_transpose_v_and_additive_is_the_formula():
    torch.manual_seed(0)
    h, s = torch.randn(2, 3, 6), torch.randn(2, 5, 8)
    low = AttentionScore("low_rank", 6, 8, rank=2, d_attention=4)
    mult = AttentionScore("multiplicative", 6, 8, rank=2, d_attention=4)
    with torch.no_grad():
        mult.query.weight.copy_(low.key.weight.T @ low.query.weight)  # (M, H) = V^T U
    torch.testing.assert_close(low(h, low.project_keys(s)), mult(h, mult.project_keys(s)))
    W = mult.query.weight.T  # (H, M)
    torch.testing.assert_close(mult(h, s), torch.einsum("bth,hm,bsm->bts", h, W, s))
    add = AttentionScore("additive", 6, 8, rank=2, d_attention=4)
    manual = torch.tanh(add.query(h)[:, :, None] + add.key(s)[:, None]) @ add.v.weight[0]
    torch.testing.assert_close(add(h, add.project_keys(s)), manual)
    dot = AttentionScore("dot", 8, 8, rank=2, d_attention=4)
    torch.testing.assert_close(dot(s[:, :3], s), s[:, :3] @ s.transpose(1, 2))


@pytest.mark.parametrize("score", ["dot", "multiplicative", "low_rank", "additive"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_attention_ignores_padding(score, cell):
    model = s2s(attention=score, cell=cell, bidirectional=score != "dot")
    src = torch.tensor([[5, 6, 7, PAD, PAD], [8, 9, 10, 11, 12]])
    dec = torch.tensor([[BOS, 4, 5], [BOS, 6, 7]])
    out = model(input_ids=src, attention_mask=src != PAD, decoder_input_ids=dec)
    assert out.logits.shape == (2, 3, 20) and out.attention.shape == (2, 3, 5)
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(2, 3))
    assert out.attention[0, :, 3:].eq(0).all()
    alone = model(input_ids=src[:1, :3], decoder_input_ids=dec[:1])  # the same row without padding
    torch.testing.assert_close(alone.logits, out.logits[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone.attention, out.attention[:1, :, :3], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_shared_generate_and_beam_search_decode_the_encoder_decoder():
    model = s2s(attention="additive")
    src = torch.tensor([[5, 6, 7, PAD], [8, 9, 10, 11]])
    mask = src != PAD
    greedy = generate(model, None, 8, greedy=True, encoder_input_ids=src, encoder_attention_mask=mask)
    tokens = torch.full((2, 1), BOS)
    for _ in range(greedy.shape[1] - 1):  # naive greedy: re-run the whole prefix every step
        nxt = model(input_ids=src, attention_mask=mask, decoder_input_ids=tokens).logits[:, -1].argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    finished = (tokens == EOS).cumsum(1) - (tokens == EOS).long() > 0
    assert torch.equal(greedy, tokens.masked_fill(finished, PAD))

    one = beam_search(
        model, None, 8, num_beams=1, encoder_input_ids=src, encoder_attention_mask=mask, length_penalty=0
    )
    assert torch.equal(one.sequences, greedy[:, : one.sequences.shape[1]])
    beams = beam_search(
        model, None, 8, num_beams=4, encoder_input_ids=src, encoder_attention_mask=mask, length_penalty=0
    )
    for row, (seq, score) in enumerate(
        zip(beams.sequences, beams.scores)
    ):  # scores are the sequences' log-probs
        n = int((seq[1:] == EOS).nonzero()[0]) + 1 if (seq[1:] == EOS).any() else len(seq) - 1
        dec, labels = seq[None, :n], seq[None, 1 : n + 1]
        logits = model(
            input_ids=src[row : row + 1], attention_mask=mask[row : row + 1], decoder_input_ids=dec
        ).logits
        assert float(-token_cross_entropy(logits, labels)[0]) == pytest.approx(float(score), abs=1e-4)


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="attention='dot' needs encoder outputs"):
        Seq2SeqConfig(attention="dot", bidirectional=True)
    with pytest.raises(ValueError, match="attention must be one of"):
        Seq2SeqConfig(attention="cosine")
    with pytest.raises(ValueError, match="tie_embeddings needs d_embed == d_hidden"):
        Seq2SeqConfig(d_embed=8, d_hidden=16)
    with pytest.raises(ValueError, match="cell must be one of"):
        RNNConfig(cell="rnn")
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        RNNConfig(n_layer=0)
    with pytest.raises(ValueError, match="at least one token"):
        s2s()(input_ids=torch.tensor([[PAD, PAD]]), decoder_input_ids=torch.tensor([[BOS]]))


def test_matched_width_hits_the_parameter_count():
    cfg = RNNConfig(vocab_size=1000, n_layer=2)
    width = matched_width(500_000, cfg)
    count = RNNLanguageModel(
        RNNConfig(vocab_size=1000, n_layer=2, d_embed=width, d_hidden=width)
    ).num_params()
    step = RNNLanguageModel(
        RNNConfig(vocab_size=1000, n_layer=2, d_embed=width + 1, d_hidden=width + 1)
    ).num_params()
    assert abs(count - 500_000) <= (step - count)
