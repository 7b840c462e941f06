"""Transformer backbone: shapes, masking semantics, KV cache, packing, FLOPs, init, input validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import VARIANTS
from torch.utils.flop_counter import FlopCounterMode

from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer, sinusoid_table

V = 61


def tiny(name: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    kw = (
        {
            "vocab_size": V,
            "d_model": 24,
            "n_layer": 2,
            "n_head": 3,
            "d_ff": 40,
            "max_seq_len": 32,
            "relative_num_buckets": 8,
            "relative_max_distance": 16,
        }
        | VARIANTS[name]
        | overrides
    )
    return Transformer(ModelConfig(**kw)).eval()


def run(model: Transformer, ids: torch.Tensor, **kw) -> torch.Tensor:
    """Logits (B, T, V) of the decoder side (encoder-decoder: ids feed both sides)."""
    if model.config.arch == "encoder-decoder":
        kw.setdefault("decoder_input_ids", ids)
    with torch.no_grad():
        return model(ids, **kw).logits


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gpt", "llama", "t5"])
def test_shape_walk(name):
    """B=2, T=4, d=8, h=2, d_ff=32: every stage maps (2, 4, 8) -> (2, 4, 8)."""
    model = tiny(
        name,
        d_model=8,
        n_head=2,
        n_kv_head=None if name != "llama" else 1,
        d_ff=32,
        n_layer=1,
        logit_scale=1.0,
    )
    tokens, positions = ids(2, 4), torch.arange(4)[None]
    x = model.embed(tokens, positions, None)
    assert x.shape == (2, 4, 8)
    stack = model.decoder
    block = stack.blocks[0]
    rope = stack.rope(positions) if stack.rope is not None else None
    memory = torch.randn(2, 5, 8) if block.cross_attn is not None else None
    assert block.attn(x, rope=rope).shape == (2, 4, 8)
    if memory is not None:
        assert block.cross_attn(x, memory=memory).shape == (2, 4, 8)
    assert block.mlp(x).shape == (2, 4, 8)
    assert block(x, None, rope, memory, None, None, 0).shape == (2, 4, 8)
    assert stack(x, positions, memory=memory).shape == (2, 4, 8)
    out = model(tokens, decoder_input_ids=tokens if memory is not None else None)
    assert out.logits.shape == (2, 4, V) and out.hidden_states.shape == (2, 4, 8)


@pytest.mark.parametrize("name", ["gpt", "llama", "sinusoidal", "t5"])
def test_decoder_is_causal(name):
    model, x = tiny(name), ids(2, 10)
    for t in (0, 4, 8):
        changed = x.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % V
        kw = {"decoder_input_ids": changed} if name == "t5" else {}
        a, b = run(model, x), run(model, x if name == "t5" else changed, **kw)
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
        assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # later positions do see the change


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padded_keys_do_not_change_real_outputs(name):
    model, x = tiny(name), ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    other = x.clone()
    other[0, 6:] = (other[0, 6:] + 7) % V
    a, b = run(model, x, attention_mask=mask), run(model, other, attention_mask=mask)
    if name == "t5":  # padding in the encoder; the decoder reads it through cross-attention only
        a = run(model, x, attention_mask=mask, decoder_input_ids=x[:, :5])
        b = run(model, other, attention_mask=mask, decoder_input_ids=x[:, :5])
        torch.testing.assert_close(a, b)
        return
    torch.testing.assert_close(a[0, :6], b[0, :6])
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0, :6], run(model, x[:1, :6])[0])  # right padding == shorter input


def test_encoder_without_positions_is_permutation_equivariant():
    model, x = tiny("bert", position="none", type_vocab_size=0), ids(2, 8)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(run(model, x)[:, perm], run(model, x[:, perm]))
    with_positions = tiny("bert", type_vocab_size=0)
    assert not torch.allclose(run(with_positions, x)[:, perm], run(with_positions, x[:, perm]))


@pytest.mark.parametrize("name", ["gpt", "llama", "sinusoidal", "t5", "local_decoder"])
def test_kv_cache_matches_full_forward(name):
    model, x = tiny(name), ids(2, 9)
    source = ids(2, 7, seed=5)
    enc = {"input_ids": source} if name == "t5" else {}
    key = "decoder_input_ids" if name == "t5" else "input_ids"
    with torch.no_grad():
        full = model(**enc, **{key: x}).logits
        out = model(**enc, **{key: x[:, :4]}, use_cache=True)
        pieces, start = [out.logits], 4
        for size in (1, 2, 1, 1):
            out = model(**{key: x[:, start : start + size]}, cache=out.cache, use_cache=True)
            pieces.append(out.logits)
            start += size
    assert out.cache.seq_len == 9
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_writes_in_place_and_reorders_rows():
    """Steps write into buffers allocated once at ``capacity``; a reordering of the rows alternates between two
    buffers, an expansion to more rows copies; decoding then continues as a full forward over the reordered rows."""
    model, x = tiny("gpt"), ids(2, 9)
    with torch.no_grad():
        cache = model(x[:, :4], use_cache=True).cache
        cache.capacity = 9
        model(x[:, 4:5], cache=cache)
        buffer = cache.self_kv[1][0]
        model(x[:, 5:6], cache=cache)
        assert cache.self_kv[1][0].data_ptr() == buffer.data_ptr() and cache.seq_len == 6
        cache.reorder(torch.tensor([1, 0]))  # into the spare buffers
        spare = cache.self_kv[1][0].data_ptr()
        cache.reorder(torch.tensor([1, 0]))  # and back: two buffers, no allocation per step
        cache.reorder(torch.tensor([1, 0]))
        assert cache.self_kv[1][0].data_ptr() == spare != buffer.data_ptr()
        swapped = model(x[[1, 0], 6:7], cache=cache).logits
        cache.reorder(torch.tensor([1, 1, 0]))  # expansion: rows [0, 0, 1] of x
        expanded = model(x[[0, 0, 1], 7:9], cache=cache).logits
    torch.testing.assert_close(swapped, model(x[[1, 0], :7]).logits[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(expanded, model(x[[0, 0, 1]]).logits[:, -2:], atol=1e-5, rtol=1e-5)


def _packed_vs_separate(model: Transformer, lengths: list[int]) -> None:
    tokens = ids(1, sum(lengths), seed=len(lengths))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        kw = {"document_ids": doc_ids, "position_ids": positions}
        packed = (
            model.encode(tokens, **kw)
            if model.config.arch != "decoder"
            else model(tokens, **kw).hidden_states
        )
        start = 0
        for n in lengths:
            doc = tokens[:, start : start + n]
            alone = model.encode(doc) if model.config.arch != "decoder" else model(doc).hidden_states
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


@pytest.mark.parametrize("name", ["gpt", "sinusoidal", "bert", "t5", "modernbert", "local_decoder"])
def test_document_mask_equals_separate_forwards(name):
    _packed_vs_separate(tiny(name), [3, 6, 1, 4])


_ROPE = {}


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_document_mask_property_rope(lengths):
    model = _ROPE.setdefault("model", tiny("llama"))
    _packed_vs_separate(model, lengths)


@pytest.mark.parametrize("name", ["modernbert", "local_decoder"])
def test_local_layers_see_their_window_only(name):
    """With layer 0 global and layer 1 local (window 3), the last position's output after layer 1 depends on
    distant tokens only through layer 0: cut layer 0 (identity blocks) and a distant token changes nothing, a near
    one does; the first block of a pre-norm stack after a normed embedding has no attention norm (ModernBERT)."""
    model, x = tiny(name, n_layer=2), ids(1, 12)
    assert model.config.local_layer(1) and not model.config.local_layer(0)
    stack = model.encoder if name == "modernbert" else model.decoder
    assert isinstance(stack.blocks[0].norm1, torch.nn.Identity) == (name == "modernbert")
    stack.blocks[0].forward = lambda x, *args: x
    far, near = x.clone(), x.clone()
    far[0, 2], near[0, 9] = (x[0, 2] + 1) % V, (x[0, 9] + 1) % V
    base, last = run(model, x)[0, -1], lambda y: run(model, y)[0, -1]
    assert torch.equal(last(far), base) and not torch.allclose(last(near), base)


def test_prefix_lm_mask():
    model, x = tiny("gpt"), ids(2, 8)
    prefix = torch.tensor([4, 0])
    base = run(model, x, prefix_lengths=prefix)
    torch.testing.assert_close(base[1], run(model, x)[1])  # prefix 0 == plain causal
    inside = x.clone()
    inside[0, 3] = (inside[0, 3] + 1) % V  # last prefix token: visible to position 0
    assert not torch.allclose(run(model, inside, prefix_lengths=prefix)[0, 0], base[0, 0])
    after = x.clone()
    after[0, 5] = (after[0, 5] + 1) % V  # beyond the prefix: causal again
    torch.testing.assert_close(run(model, after, prefix_lengths=prefix)[0, :5], base[0, :5])


@pytest.mark.parametrize(
    ("name", "overrides", "dec_len"),
    [
        ("gpt", {}, None),
        ("llama", {"n_head": 4, "n_kv_head": 2}, None),
        ("bert", {"pooler": True}, None),
        ("t5", {"tie_embeddings": False}, 6),
        ("sinusoidal", {"d_ff": 72}, None),
    ],
)
def test_flops_per_token_matches_flop_counter(name, overrides, dec_len):
    cfg = ModelConfig(
        **(
            {"vocab_size": V, "d_model": 24, "n_layer": 2, "n_head": 3, "d_ff": 40, "max_seq_len": 32}
            | VARIANTS[name]
            | overrides
        )
    )
    with torch.device("meta"):
        model = Transformer(cfg)
        x = torch.zeros(2, 12, dtype=torch.long)
        dec = torch.zeros(2, dec_len or 12, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        kw = {"decoder_input_ids": dec} if cfg.arch == "encoder-decoder" else {}
        model(x, **kw).logits.float().sum().backward()
    measured = counter.get_total_flops() / 2 / 12  # per sample, per input token
    assert model.flops_per_token(12, dec_len) == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize(
    ("name", "call", "field"),
    [
        ("gpt", lambda m: m(torch.tensor([[1, V]])), "input_ids"),
        ("gpt", lambda m: m(torch.tensor([[-1, 2]])), "input_ids"),
        ("gpt", lambda m: m(torch.zeros(1, 33, dtype=torch.long)), "max_seq_len"),
        ("sinusoidal", lambda m: m(torch.zeros(1, 40, dtype=torch.long)), "max_seq_len"),
        (
            "gpt",
            lambda m: m(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 40]])),
            "position_ids",
        ),
        (
            "gpt",
            lambda m: m(
                torch.zeros(1, 2, dtype=torch.long),
                cache=m(torch.zeros(1, 31, dtype=torch.long), use_cache=True).cache,
            ),
            "max_seq_len",
        ),
        ("t5", lambda m: m(torch.zeros(1, 4, dtype=torch.long)), "decoder_input_ids"),
        (
            "bert",
            lambda m: m(torch.zeros(1, 4, dtype=torch.long), prefix_lengths=torch.tensor([2])),
            "prefix_lengths",
        ),
        ("gpt", lambda m: m.encode(torch.zeros(1, 4, dtype=torch.long)), "arch"),
        ("gpt", lambda m: m(None), "input_ids"),
        ("bert", lambda m: m(torch.zeros(1, 4, dtype=torch.long), use_cache=True), "use_cache"),
    ],
)
def test_bad_inputs_raise_value_error_naming_field(name, call, field):
    with pytest.raises(ValueError, match=field):
        call(tiny(name))


def test_check_inputs_flag_skips_data_dependent_checks():
    model = tiny("gpt")
    model.check_inputs = False
    with pytest.raises(IndexError):  # no friendly message, but also no device sync in the hot path
        model(torch.tensor([[1, V]]))


def test_gradient_checkpointing_gives_same_gradients():
    grads = []
    for flag in (False, True):
        model = tiny("llama").train()
        model.gradient_checkpointing = flag
        model(ids(2, 8)).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("name", ["bert", "gpt", "t5"])
def test_head_at_target_positions_equals_all_positions(name):
    """Loss and every gradient of the gathered head (transform + decoder on N positions) equal those of the
    all-positions computation with ignored labels, in float64."""
    model = tiny(name).double()  # eval: no dropout
    x = ids(3, 16)
    labels = ids(3, 16, seed=2).masked_fill(
        torch.rand(3, 16, generator=torch.Generator().manual_seed(3)) > 0.2, -100
    )
    positions = (labels.flatten() != -100).nonzero().squeeze(1)
    kw = {"decoder_input_ids": x} if name == "t5" else {}
    results = []
    for target_positions in (None, positions):
        model.zero_grad()
        logits = model(x, target_positions=target_positions, **kw).logits
        flat_labels = labels.flatten() if target_positions is None else labels.flatten()[positions]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, V), flat_labels, ignore_index=-100, reduction="sum"
        )
        loss.backward()
        results.append((logits.shape, loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (shape_all, loss_all, grads_all), (shape_gathered, loss_gathered, grads_gathered) = results
    assert shape_all == (3, 16, V) and shape_gathered == (len(positions), V) and 0 < len(positions) < 20
    torch.testing.assert_close(loss_gathered, loss_all, rtol=1e-12, atol=0)
    for g_all, g_gathered in zip(grads_all, grads_gathered, strict=True):
        torch.testing.assert_close(g_gathered, g_all, rtol=1e-10, atol=1e-12)


def test_init_schemes():
    gpt = tiny("gpt", d_model=256, n_head=4, n_layer=8, d_ff=512)
    block = gpt.decoder.blocks[0]
    assert block.attn.q.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert block.attn.v.bias.abs().max() == 0 and block.norm1.weight.eq(1).all()
    t5 = tiny("t5", d_model=256, n_head=4, d_ff=512, tie_embeddings=False)
    attn, d, dh = t5.encoder.blocks[0].attn, 256, 64
    assert attn.q.weight.std().item() == pytest.approx((d * dh) ** -0.5, rel=0.05)
    assert attn.k.weight.std().item() == pytest.approx(d**-0.5, rel=0.05)
    assert t5.encoder.blocks[0].mlp.proj.weight.std().item() == pytest.approx(512**-0.5, rel=0.05)
    assert t5.embed.tok.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert t5.lm_head.weight.std().item() == pytest.approx(1.0, rel=0.05)


def test_tied_embeddings_and_num_params():
    tied, untied = tiny("gpt"), tiny("gpt", tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.tok.weight
    assert untied.lm_head.weight is not untied.embed.tok.weight
    assert untied.num_params() - tied.num_params() == V * 24
    manual = sum(p.numel() for n, p in tied.named_parameters() if not n.startswith("embed.tok"))
    assert tied.num_params(exclude_embeddings=True) == manual - 32 * 24  # minus position table


def test_dropout_only_in_training():
    model, x = tiny("gpt", dropout=0.3, attn_dropout=0.3), ids(2, 6)
    torch.testing.assert_close(run(model, x), run(model, x))
    model.train()
    assert not torch.allclose(model(x).logits, model(x).logits)


def test_sinusoid_table_formula():
    table = sinusoid_table(50, 16)
    p, i = 37, 3
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 16)), abs=1e-5)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 16)), abs=1e-5)


@pytest.mark.parametrize("name", ["gpt", "llama", "t5"])
def test_state_dicts_with_fused_projections_load(name):
    """A state dict of the earlier layout (fused ``attn.qkv`` = [q; k; v], ``cross_attn.kv`` = [k; v], a GLU's
    ``mlp.fc`` = [gate; fc]) loads into today's separate projections and computes the same logits."""
    model = tiny(name)
    state = model.state_dict()
    fused = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        owner, _, part = module.rpartition(".")
        groups = {"attn": {"q": "qkv", "k": "qkv", "v": "qkv"}, "cross_attn": {"k": "kv", "v": "kv"}}
        groups["mlp"] = {"gate": "fc", "fc": "fc"} if model.config.gated else {}
        target = groups.get(owner.rpartition(".")[2], {}).get(part)
        name_ = f"{owner}.{target}.{leaf}" if target else key
        fused.setdefault(name_, []).append(tensor)
    fused = {k: torch.cat(v) for k, v in fused.items()}
    assert any(".attn.qkv." in k for k in fused) and not any(".attn.q." in k for k in fused)
    fresh = tiny(name, init_std=0.5)
    fresh.load_state_dict(fused)
    x = ids(2, 7)
    torch.testing.assert_close(run(fresh, x), run(model, x), rtol=0, atol=0)
