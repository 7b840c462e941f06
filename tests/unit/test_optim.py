"""AdamW parameter groups (decay on matrices only) and the learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.config import OptimConfig
from pretrain.config.run import check_optim
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.optim import build_optimizer, build_scheduler, lr_lambda, param_groups, wait_before_update

TINY = {"vocab_size": 64, "d_model": 16, "n_layer": 2, "n_head": 2, "d_ff": 32, "max_seq_len": 16}
MODELS = {
    "gpt": ModelConfig(arch="decoder", **TINY),
    "bert": ModelConfig(
        arch="encoder", type_vocab_size=2, mlm_head_transform=True, lm_head_bias=True, **TINY
    ),
    "t5": ModelConfig(
        arch="encoder-decoder",
        norm="rmsnorm",
        norm_bias=False,
        position="relative",
        tie_embeddings=False,
        activation="geglu",
        **TINY,
    ),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_decay_exactly_on_linear_weights(kind):
    model = Transformer(MODELS[kind])
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    assert {id(p) for p in decay["params"]} == linear - embedding  # a tied LM head is the embedding: no decay
    assert all(p.ndim == 1 or id(p) in embedding for p in no_decay["params"])  # norms, biases, tables
    every = decay["params"] + no_decay["params"]
    assert len({id(p) for p in every}) == len(every) == len(list(model.parameters()))
    assert sum(p.numel() for p in every) == model.num_params()


def test_weight_decay_is_applied_to_the_decay_group_only():
    model = Transformer(MODELS["gpt"])
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if id(p) in decayed else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=name)


def test_fused_adamw_matches_the_reference_update():
    """The fused kernel (chosen on CPU too) steps exactly as torch's per-tensor AdamW over the same groups."""
    model = Transformer(MODELS["gpt"])
    reference = Transformer(MODELS["gpt"])
    reference.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=0.01, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"]
    ref = torch.optim.AdamW(param_groups(reference, 0.1), lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "inverse_sqrt", "constant"])
def test_warmup_is_linear_then_schedule(schedule):
    fn = lr_lambda(OptimConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1), max_steps=110)
    assert [fn(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert all(fn(s + 1) <= fn(s) + 1e-12 for s in range(9, 200))  # non-increasing from the peak
    assert all(fn(s) >= 0.1 - 1e-12 for s in range(300))


def test_schedule_values():
    cfg = {"warmup_steps": 10, "min_lr_ratio": 0.1}
    cosine = lr_lambda(OptimConfig(schedule="cosine", **cfg), 110)
    assert cosine(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way
    assert cosine(110) == pytest.approx(0.1) and cosine(500) == pytest.approx(0.1)
    linear = lr_lambda(OptimConfig(schedule="linear", **cfg), 110)
    assert linear(35) == pytest.approx(0.1 + 0.9 * 0.75)
    inv = lr_lambda(OptimConfig(schedule="inverse_sqrt", **cfg), 110)
    assert inv(39) == pytest.approx(math.sqrt(10 / 40))
    assert lr_lambda(OptimConfig(schedule="constant", **cfg), 110)(10_000) == 1.0
    decay_steps = lr_lambda(OptimConfig(schedule="linear", decay_steps=20, **cfg), 110)
    assert decay_steps(20) == pytest.approx(0.1)


def test_no_warmup_starts_at_the_peak():
    assert lr_lambda(OptimConfig(schedule="cosine", warmup_steps=0), 100)(0) == pytest.approx(1.0)


def test_bad_schedule_settings_are_all_named():
    with pytest.raises(ValueError, match=r"warmup_steps must be >= 0, got -1; optim.min_lr_ratio must be in"):
        check_optim(OptimConfig(warmup_steps=-1, min_lr_ratio=1.5))


def test_scheduler_drives_the_optimizer_lr():
    model = Transformer(MODELS["gpt"])
    opt = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=4, schedule="constant"))
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=4, schedule="constant"), 10)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_muon_on_a_model_without_hidden_matrices_is_one_line():
    """`pretrain baseline sgns-tiny optim.name=muon`: SGNS has embeddings only, and torch's 'optimizer got an empty
    parameter list' ended in a traceback ('this is a bug in pretrain'). Found by the #32 sweep."""
    from pretrain.errors import InputError

    with pytest.raises(InputError, match="optim.name=muon: Embedding has no weight matrices Muon trains"):
        build_optimizer(nn.Embedding(10, 4), OptimConfig(name="muon"))


@pytest.mark.parametrize("call", ["closure keyword", "closure positional", "no closure"])
@pytest.mark.parametrize("muon", [False, True])
def test_the_wait_before_an_update_comes_after_the_closure_that_runs_forward_and_backward(call, muon):
    """Lightning calls ``optimizer.step(closure=...)`` and the forward and backward pass run inside it: the wait
    comes after them (a background copy overlaps them) and before any parameter changes; with no closure, before
    the step."""
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2, max_seq_len=16))
    optimizer = build_optimizer(model, OptimConfig(name="muon" if muon else "adamw", lr=1e-2))
    weight = model.lm_head.weight if model.lm_head is not None else model.embed.tok.weight
    before = weight.detach().clone()
    order: list[str] = []

    def wait() -> None:
        order.append("wait")
        assert torch.equal(weight.detach(), before), "a parameter changed before the wait"

    def closure() -> torch.Tensor:
        order.append("closure")
        loss = model(torch.randint(0, 64, (2, 8))).logits.square().mean()
        loss.backward()
        return loss

    wait_before_update(optimizer, wait)
    if call == "no closure":
        closure()
        optimizer.step()
    elif call == "closure keyword":
        optimizer.step(closure=closure)
    else:
        optimizer.step(closure)
    assert order == ["closure", "wait"]
    assert not torch.equal(weight.detach(), before)  # the update did happen, after the wait
