"""generate(): cached decoding equals naive decoding and transformers' generate; sampling filters and seeding."""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.models.config import ModelConfig
from pretrain.models.generation import generate, next_token
from pretrain.models.transformer import Transformer

V = 53
DECODER = {"arch": "decoder"}
LLAMA = {
    "arch": "decoder",
    "norm": "rmsnorm",
    "norm_bias": False,
    "position": "rope",
    "activation": "swiglu",
    "n_kv_head": 1,
}
T5 = {
    "arch": "encoder-decoder",
    "norm": "rmsnorm",
    "norm_bias": False,
    "position": "relative",
    "attn_scale": "none",
    "activation": "relu",
    "mlp_bias": False,
    "attn_bias": False,
    "init": "t5",
    "decoder_start_token_id": 0,
}


def tiny(arch: dict, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = (
        {"vocab_size": V, "d_model": 24, "n_layer": 2, "n_head": 3, "d_ff": 40, "max_seq_len": 40} | arch | kw
    )
    return Transformer(ModelConfig(**cfg)).eval()


def prompt(B: int = 2, T: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def naive_greedy(model: Transformer, tokens: torch.Tensor, n: int, source: torch.Tensor | None = None):
    """Re-run the full forward every step, no cache."""
    for _ in range(n):
        with torch.no_grad():
            kw = (
                {"input_ids": source, "decoder_input_ids": tokens}
                if source is not None
                else {"input_ids": tokens}
            )
            logits = model(**kw).logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("arch", [DECODER, LLAMA])
def test_greedy_with_cache_equals_naive_decoder(arch):
    model, x = tiny(arch), prompt()
    assert torch.equal(generate(model, x, 12, greedy=True), naive_greedy(model, x, 12))


def test_greedy_with_cache_equals_naive_encoder_decoder():
    model, source = tiny(T5), prompt(T=7)
    start = torch.zeros(2, 1, dtype=torch.long)
    out = generate(model, None, 10, greedy=True, encoder_input_ids=source)
    assert torch.equal(out, naive_greedy(model, start, 10, source))


@pytest.mark.parametrize("arch", [DECODER, LLAMA])
def test_left_padded_batch_equals_unpadded_rows(arch):
    model = tiny(arch)
    short, long = prompt(1, 3, seed=2), prompt(1, 6, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :3] = 0
    out = generate(model, batch, 8, greedy=True, attention_mask=mask)
    assert torch.equal(out[0, 3:], generate(model, short, 8, greedy=True)[0])
    assert torch.equal(out[1], generate(model, long, 8, greedy=True)[0])


def test_stops_at_eos_and_pads_finished_rows():
    model, x = tiny(DECODER), prompt()
    free = generate(model, x, 10, greedy=True)
    eos = int(free[0, 7])  # row 0 emits this token at its third step
    out = generate(model, x, 10, greedy=True, eos_token_id=eos, pad_token_id=1)
    row0 = out[0, 5:].tolist()
    assert row0[: row0.index(eos) + 1] == free[0, 5 : 5 + row0.index(eos) + 1].tolist()
    assert all(t == 1 for t in row0[row0.index(eos) + 1 :])
    if eos not in free[1, 5:].tolist():
        assert out.shape[1] == 15  # row 1 never stops, so all 10 steps run
    single = generate(model, x[:1], 10, greedy=True, eos_token_id=eos)
    assert single.shape[1] == 5 + row0.index(eos) + 1  # a lone row stops right after eos


def test_sampling_is_reproducible_with_a_seeded_generator():
    model, x = tiny(DECODER), prompt()
    a = generate(model, x, 15, temperature=1.5, generator=torch.Generator().manual_seed(7))
    b = generate(model, x, 15, temperature=1.5, generator=torch.Generator().manual_seed(7))
    c = generate(model, x, 15, temperature=1.5, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_one_and_tiny_top_p_are_greedy():
    model, x = tiny(LLAMA), prompt()
    greedy = generate(model, x, 8, greedy=True)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(generate(model, x, 8, top_k=1, generator=g), greedy)
    assert torch.equal(generate(model, x, 8, top_p=1e-6, generator=g), greedy)


def test_next_token_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    top_k = next_token(logits, top_k=2, generator=g)
    assert set(top_k.tolist()) == {1, 3}
    top_p = next_token(logits, top_p=0.75, generator=g)  # 0.4 + 0.3 = 0.7 < 0.75: token 4 (0.15) completes it
    assert set(top_p.tolist()) == {1, 3, 4}
    both = next_token(logits, top_k=3, top_p=0.75, generator=g)  # top_p of the renormalised top 3 (as HF)
    assert set(both.tolist()) == {1, 3}  # 0.4 / 0.85 + 0.3 / 0.85 = 0.82 >= 0.75
    freq = torch.bincount(next_token(logits, generator=g), minlength=5) / 4000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.03, rtol=0)
    hot = torch.bincount(next_token(logits, temperature=0.25, generator=g), minlength=5) / 4000
    assert hot[1] > 0.7  # low temperature sharpens towards the mode


def test_generate_restores_training_mode():
    model = tiny(DECODER, dropout=0.5).train()
    generate(model, prompt(), 3, greedy=True)
    assert model.training


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_arguments(kw, field):
    args = {"max_new_tokens": 3} | kw
    with pytest.raises(ValueError, match=field):
        generate(tiny(DECODER), prompt(), **args)


def test_encoder_decoder_needs_source_and_encoder_cannot_generate():
    with pytest.raises(ValueError, match="encoder_input_ids"):
        generate(tiny(T5), None, 3)
    with pytest.raises(ValueError, match="arch"):
        generate(tiny({"arch": "encoder", "norm_position": "post"}), prompt(), 3)


def test_matches_transformers_generate():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from pretrain.models.hf import from_hf

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_positions=40, n_embd=24, n_layer=2, n_head=3, bos_token_id=1, eos_token_id=2
        )
    ).eval()
    x = prompt()
    ref = gpt2.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generate(from_hf(gpt2), x, 10, greedy=True, pad_token_id=0), ref)

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=V, d_model=24, d_kv=8, d_ff=40, num_layers=2, num_heads=3, decoder_start_token_id=0
        )
    ).eval()
    ref = t5.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
    assert torch.equal(generate(from_hf(t5), None, 10, greedy=True, encoder_input_ids=x), ref)
