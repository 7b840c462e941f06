"""Muon (parameter groups, update = torch.optim.Muon + AdamW, state round trip), muP (per-group LR equal to the
``mup`` package's MuAdam, coordinate check, export folding) and the fast recipe's model options."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.compat.muon import newton_schulz, resolve
from pretrain.config import OptimConfig
from pretrain.config.run import MuonConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import MLP, Transformer
from pretrain.optim import build_optimizer, hidden_matrices, lr_lambda, param_groups

TINY = {"vocab_size": 64, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "max_seq_len": 16}
MODELS = {
    "gpt": ModelConfig(arch="decoder", tie_embeddings=False, **TINY),
    "bert": ModelConfig(
        arch="encoder",
        type_vocab_size=2,
        mlm_head_transform=True,
        lm_head_bias=True,
        norm_position="post",
        embedding_norm=True,
        **TINY,
    ),
    "t5": ModelConfig(
        arch="encoder-decoder",
        norm="rmsnorm",
        norm_bias=False,
        position="relative",
        tie_embeddings=False,
        activation="geglu",
        attn_scale="none",
        init="t5",
        **TINY,
    ),
}
MUON = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, muon=MuonConfig(lr=0.02, weight_decay=0.05))


def lm_loss(model: Transformer, step: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step))
    kwargs = {"decoder_input_ids": ids[:, :-1]} if model.config.arch == "encoder-decoder" else {}
    logits = model(ids[:, :-1], **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def train(model: Transformer, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        lm_loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()


# ------------------------------------------------------------------------------------------------ Muon
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_muon_takes_the_hidden_linear_weights_and_adamw_the_rest(kind):
    model = Transformer(MODELS[kind])
    groups = {g["name"]: g for g in param_groups(model, 0.1, muon=True)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head}
    assert {id(p) for p in groups["muon"]["params"]} == linear
    adamw = [p for name, g in groups.items() if name != "muon" for p in g["params"]]
    assert id(model.embed.tok.weight) in {id(p) for p in adamw}  # embeddings, head, norms, biases
    assert all(p.ndim == 1 or id(p) not in linear for p in adamw)
    every = groups["muon"]["params"] + adamw
    assert len({id(p) for p in every}) == len(every) == len(list(model.parameters()))


def test_muon_step_equals_torch_muon_and_adamw_side_by_side():
    """The one optimizer steps exactly as torch.optim.Muon on the hidden matrices plus AdamW on the rest."""
    torch.manual_seed(0)
    model, reference = Transformer(MODELS["gpt"]), Transformer(MODELS["gpt"])
    reference.load_state_dict(model.state_dict())
    optimizer = build_optimizer(
        model, dataclasses.replace(MUON, muon=dataclasses.replace(MUON.muon, ns_dtype="bfloat16"))
    )
    hidden = {id(p) for p in hidden_matrices(reference)}
    muon = torch.optim.Muon(hidden_matrices(reference), lr=0.02, weight_decay=0.05, momentum=0.95)
    rest = [p for p in reference.parameters() if id(p) not in hidden]
    head = reference.lm_head.weight
    groups = [{"params": [head], "weight_decay": 0.1}, {"params": [p for p in rest if p is not head]}]
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    for step in range(3):
        lm_loss(model, step).backward()
        lm_loss(reference, step).backward()
        optimizer.step()
        muon.step()
        adamw.step()
        for opt in (optimizer, muon, adamw):
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_newton_schulz_is_torchs_iteration_in_the_chosen_dtype(shape):
    """In bfloat16 it equals torch's private iteration bit for bit; in float32 it is that iteration in float32,
    closer to the float64 one than torch's bfloat16 result."""
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    args = ((3.4445, -4.775, 2.0315), 5, 1e-7)
    bf16 = newton_schulz(grad, *args, dtype=torch.bfloat16)
    assert torch.equal(bf16, torch_ns(grad, *args))
    fp32, fp64 = (newton_schulz(grad, *args, dtype=d) for d in (torch.float32, torch.float64))
    assert fp32.dtype == torch.float32 and fp32.shape == shape
    torch.testing.assert_close(fp32.double(), fp64, rtol=0, atol=1e-5)
    assert (bf16.double() - fp64).abs().max() > 100 * (fp32.double() - fp64).abs().max()


def test_muon_ns_dtype_float32_orthogonalises_the_update_in_float32():
    """One step of ``optim.muon.ns_dtype=float32`` on a square hidden matrix: W (1 - lr wd) - lr NS32(update),
    update = g.lerp((1 - mu) g, mu) (Nesterov, fresh momentum); torch's own function is back afterwards."""
    from torch.optim import _muon

    torch.manual_seed(0)
    model = Transformer(MODELS["gpt"])
    cfg = dataclasses.replace(MUON, muon=dataclasses.replace(MUON.muon, ns_dtype="float32"))
    optimizer = build_optimizer(model, cfg)
    weight = next(p for p in hidden_matrices(model) if p.shape[0] == p.shape[1])
    before = weight.detach().clone()
    original = _muon._zeropower_via_newtonschulz
    lm_loss(model, 0).backward()
    grad = weight.grad.clone()
    optimizer.step()
    assert _muon._zeropower_via_newtonschulz is original
    update = grad.lerp((1 - 0.95) * grad, 0.95)
    ns = newton_schulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7, dtype=torch.float32)
    torch.testing.assert_close(weight.detach(), before * (1 - 0.02 * 0.05) - 0.02 * ns)
    bf16 = newton_schulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7, dtype=torch.bfloat16)
    assert not torch.allclose(weight.detach(), before * (1 - 0.02 * 0.05) - 0.02 * bf16, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected",
    [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")],
)
def test_auto_ns_dtype_is_bfloat16_where_matmuls_have_it(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve("auto", torch.device("cpu")) == expected
    assert resolve("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve("float32", torch.device("cuda", 0)) == "float32"
    assert MuonConfig().ns_dtype == "auto"


def test_muon_state_dict_round_trip_resumes_exactly():
    torch.manual_seed(0)
    full, resumed = Transformer(MODELS["t5"]), Transformer(MODELS["t5"])
    resumed.load_state_dict(full.state_dict())
    optimizer = build_optimizer(full, MUON)
    train(full, optimizer, range(2))
    saved_model, saved_opt = copy.deepcopy(full.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(full, optimizer, range(2, 4))

    resumed.load_state_dict(saved_model)
    again = build_optimizer(resumed, MUON)
    again.load_state_dict(saved_opt)
    assert again.muon.state is again.state and again.muon.param_groups[0] is again.param_groups[0]
    train(resumed, again, range(2, 4))
    for (name, p), q in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def same(a, b) -> bool:
    """Nested containers of equal structure with bitwise-equal tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_a_skipped_step_is_selected_on_the_device_and_a_finite_one_is_the_plain_step():
    """``found_inf`` (as the guards pass it): 1 leaves weights, Muon's buffers and AdamW's state bitwise as they
    were, a NaN gradient included; 0 is the step without it, bit for bit; the verdict is never read on the host."""
    from pretrain.training.callbacks.host_sync import HostReadMode

    torch.manual_seed(0)
    model, plain = Transformer(MODELS["gpt"]), Transformer(MODELS["gpt"])
    plain.load_state_dict(model.state_dict())
    guarded, reference = build_optimizer(model, MUON), build_optimizer(plain, MUON)
    assert guarded.skips_on_device  # fused AdamW on the CPU
    for step, skip in enumerate([0.0, 1.0, 0.0, 1.0]):
        for m in (model, plain):
            lm_loss(m, step).backward()
        if skip:
            hidden_matrices(model)[1].grad[0, 0] = float("nan")
            before = copy.deepcopy((model.state_dict(), guarded.state_dict()))
        guarded.found_inf = torch.tensor(skip)
        with HostReadMode("error"):  # a host read of the verdict would raise
            guarded.step()
        del guarded.found_inf
        if skip:
            assert same(before, (model.state_dict(), guarded.state_dict()))  # every buffer and step count
        else:
            reference.step()
        for m, opt in ((model, guarded), (plain, reference)):
            opt.zero_grad()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p, q)


def test_schedule_scales_muon_and_adamw_lr_together():
    from pretrain.optim import build_scheduler

    model = Transformer(MODELS["gpt"])
    optimizer = build_optimizer(model, dataclasses.replace(MUON, warmup_steps=4))
    scheduler = build_scheduler(optimizer, dataclasses.replace(MUON, warmup_steps=4), 10)
    scheduler.step()
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs["muon"] == pytest.approx(0.02 * 2 / 4) and lrs["no_decay"] == pytest.approx(1e-2 * 2 / 4)
    assert optimizer.muon.param_groups[0]["lr"] == lrs["muon"]  # the inner optimizer sees it


def test_wsd_schedule_is_flat_then_decays_linearly_over_the_cooldown():
    cfg = OptimConfig(schedule="wsd", warmup_steps=2, min_lr_ratio=0.0, cooldown_fraction=0.25)
    fn = lr_lambda(cfg, 100)
    assert [fn(s) for s in (0, 1)] == [0.5, 1.0]
    assert fn(50) == fn(75) == 1.0
    assert fn(80) == pytest.approx(20 / 25) and fn(99) == pytest.approx(1 / 25) and fn(100) == 0.0


# ------------------------------------------------------------------------------------------------ muP
def mup_config(width: int, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        d_model=width,
        n_layer=2,
        n_head=width // 16,
        max_seq_len=16,
        parametrization="mup",
        mup_base_width=64,
        tie_embeddings=False,
        **kw,
    )


def test_mup_adamw_groups_equal_the_mup_package():
    """Per-parameter learning rate and weight decay equal mup.MuAdam's after mup.set_base_shapes (reference)."""
    import mup  # the reference (make install installs it)

    model = Transformer(mup_config(256))
    base, delta = Transformer(mup_config(64)), Transformer(mup_config(128))
    mup.set_base_shapes(model, base, delta=delta, rescale_params=False, do_assert=False)  # no MuReadout
    reference = mup.MuAdam(param_groups(model, 0.1), lr=1e-2, impl=torch.optim.AdamW)
    expected = {id(p): (g["lr"], g["weight_decay"]) for g in reference.param_groups for p in g["params"]}
    ours = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), width_mult=4.0)
    got = {id(p): (g["lr"], g["weight_decay"]) for g in ours.param_groups for p in g["params"]}
    assert got.keys() == expected.keys()
    assert {key: pytest.approx(value) for key, value in got.items()} == expected  # approx per (lr, wd) pair
    assert {g["lr"] for g in ours.param_groups} == {1e-2, 1e-2 / 4}


def coordinate_config(family: str, width: int, parametrization: str) -> ModelConfig:
    """gpt: 2 decoder layers; bert / t5 (``MODELS``' encoder and encoder-decoder at ``width``): 1 layer per stack,
    d_ff = 2 d (cheap); head dim 16, base width 64 throughout. t5 as v1.0: tied, logits x d^-1/2 frozen at the
    base width (muP keeps multipliers tuned at the base; v1.1's untied N(0, 1) head is 8x larger at d = 64, so
    its initial logits, which muP lets decay as m^-1/2, outweigh 4 steps' updates and the logits spread 3x)."""
    if family == "gpt":
        return dataclasses.replace(mup_config(width), parametrization=parametrization)
    t5 = {"tie_embeddings": True, "logit_scale": 64**-0.5} if family == "t5" else {}
    return dataclasses.replace(
        MODELS[family],
        **t5,
        d_model=width,
        n_head=width // 16,
        head_dim=None,
        d_ff=2 * width,
        n_layer=1,
        n_decoder_layer=None,
        parametrization=parametrization,
        mup_base_width=64,
    )


def coordinate_rms(parametrization: str, width: int, optim: str, family: str = "gpt") -> list[float]:
    """After 4 steps at a fixed base LR: the RMS of each block's output (encoder, then decoder) and of the
    logits' change since init. muP lets the logits at init vanish with width (readout variance ~ 1/d^2: T5's
    N(0, 1) head starts at RMS 8 at width 64 and 2 at 1024) but keeps every update's effect Theta(1)."""
    torch.manual_seed(0)
    cfg = coordinate_config(family, width, parametrization)
    model = Transformer(cfg)
    opt = OptimConfig(name=optim, lr=3e-3, weight_decay=0.0, warmup_steps=0)
    optimizer = build_optimizer(model, opt, width_mult=cfg.width_mult)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(99))
    kwargs = {"decoder_input_ids": ids} if cfg.arch == "encoder-decoder" else {}
    with torch.no_grad():
        initial = model(ids, **kwargs).logits
    train(model, optimizer, range(4))
    rms = []
    blocks = [b for stack in (model.encoder, model.decoder) if stack is not None for b in stack.blocks]
    hooks = [b.register_forward_hook(lambda m, i, o: rms.append(o.pow(2).mean().sqrt())) for b in blocks]
    with torch.no_grad():
        rms.append((model(ids, **kwargs).logits - initial).pow(2).mean().sqrt())
    for h in hooks:
        h.remove()
    return [float(r) for r in rms]


@pytest.mark.parametrize("family", ["gpt", "bert", "t5"])
def test_coordinate_check_flat_under_mup_and_growing_under_standard(family, optim="adamw"):
    """Per-layer activation RMS after 4 AdamW steps, widths 64 / 256 / 1024: within 2x under muP, growing > 2x
    under standard, for decoder, encoder and encoder-decoder. Muon + muP is as flat (gpt: max/min 1.2; standard
    3-7x) but its bf16 Newton-Schulz on 1024 x 4096 matrices costs ~2 CPU minutes, so CI checks AdamW;
    ``coordinate_rms(..., "muon")`` reproduces it."""
    widths = (64, 256, 1024)
    for parametrization in ("mup", "standard"):
        per_width = torch.tensor(
            [coordinate_rms(parametrization, w, optim, family) for w in widths]
        )  # (widths, layers)
        spread = per_width.max(0).values / per_width.min(0).values
        if parametrization == "mup":
            assert (spread < 2).all(), (
                f"muP activations not flat across widths {widths}: {per_width.tolist()}"
            )
        else:
            assert (per_width[-1] / per_width[0]).max() > 2, f"standard did not grow: {per_width.tolist()}"


def hf_family_config(family: str, tied: bool) -> ModelConfig:
    """The config from_hf gives a tiny transformers BertForMaskedLM / T5ForConditionalGeneration (d 128), so
    the family's every other field is one HF can express."""
    import transformers

    from pretrain.models.hf import from_hf

    if family == "bert":
        hf_config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=16,
        )
        hf = transformers.BertForMaskedLM(hf_config)
    else:
        hf_config = transformers.T5Config(
            vocab_size=64,
            d_model=128,
            d_kv=32,
            d_ff=256,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
        )
        hf = transformers.T5ForConditionalGeneration(hf_config)
    # T5 tied: logits scaled by d^-1/2 as in HF; untied (v1.1): unscaled
    return dataclasses.replace(
        from_hf(hf).config,
        tie_embeddings=tied,
        logit_scale=128**-0.5 if family == "t5" and tied else 1.0,
        parametrization="mup",
        mup_base_width=64,
    )


@pytest.mark.parametrize(
    "family,options",
    [
        ("gpt", {"tie_embeddings": False}),
        ("gpt", {"tie_embeddings": True}),
        ("gpt", {"tie_embeddings": False, "mup_attn_multiplier": 4.0}),
        (
            "gpt",
            {
                "position": "rope",
                "norm": "rmsnorm",
                "norm_bias": False,
                "activation": "swiglu",
                "attn_bias": False,
            },
        ),
        ("bert", {"tie_embeddings": True}),
        ("bert", {"tie_embeddings": False}),
        (
            "bert",
            {
                "tie_embeddings": True,
                "lm_head": False,
                "lm_head_bias": False,
                "mlm_head_transform": False,
                "pooler": True,
            },
        ),
        ("t5", {"tie_embeddings": True}),
        ("t5", {"tie_embeddings": False}),
    ],
    ids=[
        "gpt2-untied",
        "gpt2-tied",
        "gpt2-attn-multiplier",
        "llama",
        "bert-tied",
        "bert-untied",
        "bert-model",
        "t5-tied",
        "t5-untied",
    ],
)
def test_mup_exports_to_transformers_with_equal_logits(family, options):
    """to_hf folds the 1/d_h attention scale and the 1/m logit multiplier into the weights: the logits (BertModel:
    the hidden states) of transformers equal ours; tied BERT and T5 heads stay tied (1/m goes into the norm
    before the head), tied GPT-2 / Llama heads export untied."""
    from pretrain.models.hf import _is_tied, to_hf

    torch.manual_seed(0)
    cfg = mup_config(128) if family == "gpt" else hf_family_config(family, options["tie_embeddings"])
    model = Transformer(dataclasses.replace(cfg, **options)).eval()
    assert model.config.width_mult == 2.0
    for p in model.parameters():  # away from init, so every multiplier matters
        p.data.normal_(0, 0.2)
    ids = torch.randint(0, 64, (2, 16))
    kwargs = {"decoder_input_ids": ids.flip(1)} if family == "t5" else {}
    hf = to_hf(model).eval()
    ours, theirs = model(ids, **kwargs), hf(ids, **kwargs)
    if model.config.lm_head:
        torch.testing.assert_close(theirs.logits, ours.logits, atol=1e-5, rtol=1e-4)
        assert _is_tied(hf) == (family != "gpt" and options["tie_embeddings"])
    else:
        torch.testing.assert_close(theirs.last_hidden_state, ours.hidden_states, atol=1e-5, rtol=1e-4)


def test_mup_attn_multiplier_scales_the_attention_logits():
    """softmax(a q k^T / d_h) with a = mup_attn_multiplier: the same model as a = 1 with its query rows times a;
    a = sqrt(d_h) is standard attention q k^T / sqrt(d_h) on the same weights."""
    torch.manual_seed(0)
    cfg = mup_config(64, attn_bias=False)  # m = 1: muP differs from standard only in the attention
    a = cfg.head_dim**0.5
    scaled = Transformer(dataclasses.replace(cfg, mup_attn_multiplier=a)).eval()
    for p in scaled.parameters():  # away from init, so the attention pattern matters
        p.data.normal_(0, 0.2)
    plain = Transformer(cfg).eval()
    standard = Transformer(dataclasses.replace(cfg, parametrization="standard")).eval()
    plain.load_state_dict(scaled.state_dict())
    standard.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(scaled(ids).logits, standard(ids).logits, atol=1e-5, rtol=1e-4)
    assert (scaled(ids).logits - plain(ids).logits).abs().max() > 1e-2
    with torch.no_grad():
        for block in plain.decoder.blocks:
            block.attn.q.weight.mul_(a)
    torch.testing.assert_close(scaled(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ recipe options
def block_of(model: Transformer):
    return model.decoder.blocks[0]


def test_qk_norm_normalises_queries_and_keys_per_head():
    """With qk_norm, scaling the q and k projections leaves the output unchanged (RMSNorm)."""
    for qk_norm in (True, False):
        torch.manual_seed(0)
        attn = block_of(
            Transformer(dataclasses.replace(MODELS["gpt"], qk_norm=qk_norm, attn_bias=False))
        ).attn
        x = torch.randn(2, 8, 32)
        before = attn(x)
        with torch.no_grad():
            attn.q.weight *= 7.0
            attn.k.weight *= 7.0
        change = float((attn(x) - before).norm() / before.norm())
        assert (change < 1e-3) if qk_norm else (change > 0.1), change


def test_relu2_mlp_is_relu_squared():
    torch.manual_seed(0)
    mlp = MLP(dataclasses.replace(MODELS["gpt"], activation="relu2"))
    x = torch.randn(3, 32)
    torch.testing.assert_close(mlp(x), mlp.proj(torch.relu(mlp.fc(x)) ** 2))


def test_zero_init_projections_start_every_residual_branch_at_zero():
    model = Transformer(dataclasses.replace(MODELS["gpt"], zero_init_projections=True))
    for block in model.decoder.blocks:
        assert not block.attn.out.weight.any() and not block.mlp.proj.weight.any()
        assert block.attn.q.weight.std() > 0.01
    plain = Transformer(MODELS["gpt"])
    assert plain.decoder.blocks[0].mlp.proj.weight.any()


def test_fast_recipe_options_export_or_are_refused_in_one_line():
    """relu2, untied head, zero-init: transformers GPT-2 computes the same logits; qk_norm: one-line refusal."""
    from pretrain.models.hf import to_hf

    torch.manual_seed(0)
    options = {"activation": "relu2", "tie_embeddings": False, "zero_init_projections": True}
    model = Transformer(dataclasses.replace(MODELS["gpt"], **options)).eval()
    for block in model.decoder.blocks:  # trained away from zero
        block.mlp.proj.weight.data.normal_(0, 0.1)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(to_hf(model).eval()(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"^GPT2LMHeadModel cannot express this model: qk_norm=True") as err:
        to_hf(Transformer(dataclasses.replace(MODELS["gpt"], qk_norm=True)))
    assert "\n" not in str(err.value)


def test_bad_muon_and_mup_settings_are_one_line_errors():
    from pretrain.config.run import RunConfig, validate

    base = dataclasses.asdict(RunConfig())
    cases = [
        (
            {"optim": {"name": "muon"}, "strategy": {"name": "deepspeed"}},
            "not supported with strategy deepspeed",
        ),
        ({"optim": {"name": "muon", "muon": {"ns_steps": 0}}}, "ns_steps in"),
        (
            {
                "optim": {"name": "muon", "muon": {"adjust_lr": "match_rms_adamw"}},
                "model": {"parametrization": "mup"},
            },
            "breaks muP transfer",
        ),
        ({"optim": {"schedule": "wsd", "cooldown_fraction": 0.0}}, "cooldown_fraction"),
        ({"model": {"parametrization": "mu-p"}}, "parametrization must be one of"),
        ({"model": {"mup_attn_multiplier": 2.0}}, "mup_attn_multiplier scales muP's attention"),
        (
            {"model": {"parametrization": "mup", "mup_attn_multiplier": 0.0}},
            "mup_attn_multiplier must be > 0",
        ),
    ]
    for override, message in cases:
        raw = copy.deepcopy(base)
        for section, values in override.items():
            for key, value in values.items():
                if isinstance(value, dict):
                    raw[section][key].update(value)
                else:
                    raw[section][key] = value
        with pytest.raises(ValueError, match=message) as err:
            validate(raw)
        assert "\n" not in str(err.value)
