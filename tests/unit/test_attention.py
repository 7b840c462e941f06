"""Attention backends: flex equals SDPA for every family and mask kind, sparse block masks equal a reference mask
built from their definition, block masks skip tiles and are cached, random blocks are reproducible, KV-cache
decoding runs the prompt under flex and the cached steps under SDPA. Flex runs eagerly (force_eager) except in
the one compiled test."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import VARIANTS

from pretrain.models import attention
from pretrain.models.attention import AttentionMask, MaskInputs, SparsePattern, attend, random_block_table
from pretrain.models.config import ModelConfig
from pretrain.models.generation import generate
from pretrain.models.transformer import Transformer

V, T = 61, 40
FAMILIES = {name: VARIANTS[name] for name in ("gpt", "llama", "bert")} | {
    "t5": VARIANTS["t5"] | {"decoder_start_token_id": 0, "logit_scale": 1.0}
}
SPARSE = {
    "window": {"attention_window": 7},
    "global": {"attention_global_tokens": 3, "attention_window": 5},
    "random": {"attention_random_blocks": 1, "attention_window": 4},
    "local_layers": {"global_attn_every_n_layers": 2, "local_attention_window": 5},  # ModernBERT / Gemma 2
}
KINDS = ["plain", "padding", "documents", "prefix", *SPARSE]


@pytest.fixture(autouse=True)
def eager_flex():
    """Eager flex_attention (same math, no compile time); its 'unfused implementation' warning is expected."""
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


def tiny(family: str, backend: str = "sdpa", **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = {"vocab_size": V, "d_model": 32, "n_layer": 2, "n_head": 4, "d_ff": 48, "max_seq_len": 64}
    cfg |= {"attention_block_size": 16, "attention": backend} | FAMILIES[family] | kw
    return Transformer(ModelConfig(**cfg)).eval()


def with_backend(model: Transformer, backend: str) -> Transformer:
    """A copy with the same weights under another attention backend."""
    other = Transformer(dataclasses.replace(model.config))
    other.load_state_dict(model.state_dict())
    return other.set_attention(backend).eval()


def inputs(family: str, kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, T), generator=g)
    kw = {"input_ids": ids}
    if kind == "padding":
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, 29:] = 0
        kw["attention_mask"] = mask
    if kind == "documents":
        kw["document_ids"] = torch.tensor([[0] * 17 + [1] * 23, [0] * 5 + [1] * 30 + [2] * 5])
    if kind == "prefix":
        kw["prefix_lengths"] = torch.tensor([9, 21])
    if family == "t5":
        kw["decoder_input_ids"] = torch.randint(3, V, (2, 19), generator=g)
        if kind == "padding":
            kw["decoder_attention_mask"] = torch.ones(2, 19, dtype=torch.long).index_fill(
                1, torch.arange(15, 19), 0
            )
    return kw


CASES = [(f, k) for f in FAMILIES for k in KINDS if not (k == "prefix" and FAMILIES[f]["arch"] != "decoder")]


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_flex_equals_sdpa(family, kind):
    sdpa = tiny(family, **SPARSE.get(kind, {}))
    flex = with_backend(sdpa, "flex")
    kw = inputs(family, kind)
    with torch.no_grad():
        ref, out = sdpa(**kw), flex(**kw)
    assert (ref.hidden_states - out.hidden_states).abs().max().item() <= 1e-5
    if kind in SPARSE:  # the pattern changes the function, so the comparison above is not vacuous
        with torch.no_grad():
            dense = with_backend(tiny(family), "sdpa")(**kw).hidden_states
        assert (dense - ref.hidden_states).abs().max().item() > 1e-3


def reference_mask(T: int, causal: bool, window: int, n_global: int, table: torch.Tensor | None, block: int):
    """(T, T) bool straight from the definition, one entry at a time."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(T):
            near = window == 0 or (q - k < window if causal else abs(q - k) < window)
            ok = near if (window or n_global or table is not None) else True
            if window == 0 and (n_global or table is not None):
                ok = False
            ok = ok or q < n_global or k < n_global
            ok = ok or (table is not None and bool(table[q // block, k // block]))
            allowed[q, k] = (ok and (k <= q or not causal)) or k == q
    return allowed


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 70),
    causal=st.booleans(),
    window=st.integers(0, 20),
    n_global=st.integers(0, 4),
    r=st.integers(0, 2),
    seed=st.integers(0, 3),
)
def test_sparse_block_mask_equals_reference_and_sdpa(T, causal, window, n_global, r, seed):
    pattern = SparsePattern(causal, window, n_global, r, 16, seed, min_blocks=5)
    inputs_ = MaskInputs(T, T, causal=causal, pattern=pattern)
    table = random_block_table(5, r, seed, causal) if r else None
    expected = reference_mask(T, causal, window, n_global, table, 16)
    if pattern.active or causal:
        assert torch.equal(inputs_.dense(torch.device("cpu"))[0, 0], expected)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    x = torch.zeros(1, T, 1)
    with torch.no_grad():
        out = attend(q, k, v, AttentionMask(inputs_, "flex", x), None, 0.0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=expected)
    assert (out - ref).abs().max().item() <= 1e-5


@settings(max_examples=30, deadline=None)
@given(
    chunk=st.integers(1, 7),
    size=st.integers(1, 3),
    causal=st.booleans(),
    window=st.integers(0, 9),
    n_global=st.integers(0, 2),
    documents=st.booleans(),
    prefix=st.booleans(),
    padding=st.booleans(),
    block=st.integers(1, 5),
    seed=st.integers(0, 3),
)
def test_context_parallel_blocks_equal_the_dense_mask(
    chunk, size, causal, window, n_global, documents, prefix, padding, block, seed
):
    """A context-parallel rank's queries (chunks rank and 2N-1-rank) under any self-attention mask, block by block
    with blocks of ``block`` queries reading only the keys they can reach (``BlockMasked``): the output and every
    gradient of SDPA on the dense mask of the same inputs."""
    from unittest import mock

    from pretrain.parallel.context import chunk_positions

    T, B = 2 * size * chunk, 2
    rank = seed % size
    g = torch.Generator().manual_seed(seed)
    docs = torch.randint(0, 3, (B, T), generator=g).sort(1).values if documents else None
    inputs_ = MaskInputs(
        T // size,
        T,
        causal=causal,
        document_ids=docs,
        prefix_lengths=torch.randint(0, T, (B,), generator=g) if prefix and causal else None,
        key_mask=(torch.arange(T) < T - 2).expand(B, T) if padding and not causal else None,
        pattern=SparsePattern(causal, window, n_global),
        query_positions=chunk_positions(T, rank, size),
        query_chunks=(rank * chunk, (2 * size - 1 - rank) * chunk),
    )
    q = torch.randn(B, 2, T // size, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 2, T, 8, generator=g, requires_grad=True) for _ in range(2))
    with mock.patch.multiple(attention, BLOCK_ELEMENTS=1, MIN_BLOCK_QUERIES=block):
        mask = AttentionMask(inputs_, "sdpa", q)
        ours = attend(q, k, v, mask, None, 0.0)
    if mask.chunks is None:  # everything but a plain causal mask
        assert mask.dense is None and len(mask.blocks) == 2 * -(-chunk // block)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs_.dense(torch.device("cpu")))
    weights = torch.randn(ours.shape, generator=g)
    grads = torch.autograd.grad((ours * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for ours_grad, reference_grad in zip(grads, expected, strict=True):
        torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-5, atol=1e-5)


def test_random_blocks_are_reproducible_and_r_per_row():
    table = random_block_table(8, 2, 7, False)
    assert torch.equal(table, random_block_table.__wrapped__(8, 2, 7, False))
    assert table.sum(1).tolist() == [2] * 8
    assert not torch.equal(table, random_block_table.__wrapped__(8, 2, 8, False))
    causal = random_block_table.__wrapped__(8, 2, 7, True)
    assert not causal.triu(1).any() and causal.sum(1).tolist() == [1] + [2] * 7
    a, b = tiny("bert", attention_random_blocks=2), tiny("bert", attention_random_blocks=2)
    kw = inputs("bert", "plain")
    with torch.no_grad():
        assert torch.equal(a(**kw).hidden_states, b(**kw).hidden_states)


def test_sliding_window_block_mask_skips_tiles_and_is_cached():
    model = tiny("gpt", "flex", attention_window=16, max_seq_len=256)
    x = torch.randint(0, V, (1, 256))
    with torch.no_grad():
        model(x)
        model(x)
    (block_mask,) = model.decoder.block_masks.values()
    # 16 query blocks of 16; each sees its own and the previous block only (2 of up to 16)
    assert block_mask.kv_num_blocks.max().item() + block_mask.full_kv_num_blocks.max().item() <= 2
    assert block_mask.sparsity() > 80


@pytest.mark.parametrize("family", ["gpt", "llama", "t5"])
def test_kv_cache_decoding_flex_prompt_then_sdpa_steps(family, monkeypatch):
    """Backend flex: the prompt (T5: the encoder and the first decoder step) runs flex_attention, the cached decode
    steps SDPA (flex is used without a query offset only); the tokens equal SDPA-only decoding's."""
    sdpa = tiny(family, attention_window=5)
    flex = with_backend(sdpa, "flex")
    x = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    kw = {"encoder_input_ids": x} if family == "t5" else {}
    prompt = None if family == "t5" else x
    flex_calls = []
    kernel = attention._compiled_flex()
    counted = lambda *a, **k: flex_calls.append(1) or kernel(*a, **k)
    monkeypatch.setattr(attention, "_compiled_flex", lambda: counted)
    a = generate(sdpa, prompt, 9, greedy=True, **kw)
    assert not flex_calls
    b = generate(flex, prompt, 9, greedy=True, **kw)
    prompt_calls = len(flex_calls)
    generate(flex, prompt, 3, greedy=True, **kw)
    assert prompt_calls > 0 and len(flex_calls) == 2 * prompt_calls  # as many for 3 new tokens as for 9
    assert torch.equal(a, b)
    with torch.no_grad():  # the cached decode equals the full forward of the generated sequence
        full = flex(x, decoder_input_ids=b) if family == "t5" else flex(b)
    assert torch.equal(full.logits[:, -10:-1].argmax(-1), b[:, -9:])


def test_global_token_ids_are_global():
    model = tiny("bert", attention_window=2, attention_global_token_ids=[5], n_layer=1)
    x = torch.randint(6, V, (1, T))
    x[0, 20] = 5
    changed = x.clone()
    changed[0, 0] = (x[0, 0] + 1) % V if x[0, 0] + 1 != 5 else 7
    with torch.no_grad():
        a, b = model(x).hidden_states, model(changed).hidden_states
    assert (a[0, 20] - b[0, 20]).abs().max() > 1e-4  # the global token sees position 0, 20 away
    assert torch.equal(a[0, 10], b[0, 10])  # a windowed token does not


def test_compiled_flex_equals_sdpa():
    """One compiled flex kernel (tiny shapes): T5 bias as score_mod + key padding + window, no grad."""
    sdpa = tiny("t5", arch="encoder", attention_window=9, n_layer=1, decoder_start_token_id=None)
    flex = with_backend(sdpa, "flex")
    kw = inputs("t5", "padding")
    kw = {"input_ids": kw["input_ids"], "attention_mask": kw["attention_mask"]}
    with torch.compiler.set_stance("default"), torch.no_grad():
        ref, out = sdpa(**kw).hidden_states, flex(**kw).hidden_states
    assert (ref - out).abs().max().item() <= 1e-5


def test_flex_trains_on_cpu_through_sdpa():
    """flex_attention has no CPU backward: a training step falls back to SDPA on the same mask."""
    flex = tiny("gpt", "flex", attention_window=6).train()
    sdpa = with_backend(flex, "sdpa").train()
    x = torch.randint(0, V, (2, T))
    for model in (flex, sdpa):
        model(x).logits.sum().backward()
    for (name, a), b in zip(flex.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"attention_window": 65}, "attention_window"),
        ({"attention_global_tokens": 64}, "attention_global_tokens"),
        ({"attention_block_size": 24}, "attention_block_size"),
        ({"attention_block_size": 128, "attention_random_blocks": 1}, "attention_block_size"),
        ({"attention_random_blocks": 4}, "attention_random_blocks"),
        ({"attention_global_token_ids": [5]}, "attention_global_token_ids"),
        ({"attention": "xformers"}, "attention"),
    ],
)
def test_bad_sparse_config_is_refused(kw, field):
    base = {"vocab_size": V, "d_model": 32, "n_head": 4, "max_seq_len": 64, "attention_block_size": 16}
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field} must"):
        ModelConfig(**(base | kw))
