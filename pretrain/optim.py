"""The optimizer of a run -- AdamW, or Muon for hidden matrices + AdamW for the rest -- its parameter groups
(weight decay on matrices only, muP learning-rate scaling) and the warmup + decay learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from pretrain.compat.muon import newton_schulz_dtype, resolve
from pretrain.compat.optim import honours_found_inf
from pretrain.config import OptimConfig
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def wait_before_update(optimizer: torch.optim.Optimizer, wait: Callable[[], None]) -> None:
    """Call ``wait`` at every ``optimizer.step`` before it changes a parameter or a state tensor, as late as that:
    after the closure where ``step`` is given one (Lightning's automatic optimization runs the forward and
    backward pass inside ``optimizer.step``, as that closure, after the step's pre-hooks), else before the step.
    A host copy of the state taken in the background (a snapshot, a checkpoint's staging) then overlaps the
    forward and backward pass instead of delaying them."""

    def pre_hook(
        opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        first = 1 if args and args[0] is opt else 0  # torch passes the optimizer itself as args[0]
        closure = kwargs.get("closure", args[first] if len(args) > first else None)
        if closure is None:
            wait()
            return None

        def closure_then_wait() -> Any:
            loss = closure()
            wait()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (*args[:first], closure_then_wait, *args[first + 1 :]), kwargs

    optimizer.register_step_pre_hook(pre_hook)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights mapping a hidden width to a hidden width: every trainable parameter with 2 dims except
    embedding tables (token, position, segment, T5 relative bias) and the LM head (tied or not). These are
    Muon's parameters and muP's "matrix-like" ones (both dims grow with d_model)."""
    excluded = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        excluded |= {id(p) for p in head.parameters()}
    seen: set[int] = set()
    out = []
    for p in model.parameters():  # shared (tied) parameters appear once
        if p.requires_grad and p.ndim == 2 and id(p) not in excluded and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def param_groups(
    model: nn.Module, weight_decay: float, *, width_mult: float = 1.0, muon: bool = False
) -> list[dict[str, Any]]:
    """Parameter groups, each with ``name``, ``params``, ``weight_decay`` and ``lr_mult`` (times the base LR):

    - muon (``muon=True``): :func:`hidden_matrices`, for ``torch.optim.Muon``;
    - hidden (muP only, AdamW): the same matrices at ``lr_mult = 1/m`` and ``weight_decay * m`` (the ``mup``
      package's ``MuAdam``: matrix-like parameters, ``m = width_mult``);
    - decay: the other weights with >= 2 dims that no ``nn.Embedding`` owns (GPT-2 / BERT / T5 practice);
    - no_decay: norms, biases and embedding tables (incl. a tied LM head).

    Under standard AdamW that is exactly [decay, no_decay]. Shared (tied) parameters appear once; empty groups
    are dropped.
    """
    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    hidden = {id(p) for p in hidden_matrices(model)} if muon or width_mult != 1.0 else set()
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in ("muon", "hidden", "decay", "no_decay")}
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in hidden:
            groups["muon" if muon else "hidden"].append(p)
        else:
            groups["decay" if p.ndim >= 2 and id(p) not in embedding else "no_decay"].append(p)
    settings = {
        "muon": (weight_decay, 1.0),
        "hidden": (weight_decay * width_mult, 1.0 / width_mult),
        "decay": (weight_decay, 1.0),
        "no_decay": (0.0, 1.0),
    }
    return [
        {"name": name, "params": params, "weight_decay": settings[name][0], "lr_mult": settings[name][1]}
        for name, params in groups.items()
        if params or name in ("decay", "no_decay") and not muon
    ]


def group_param_names(model: ModelConfig, weight_decay: float, *, muon: bool = False) -> list[list[str]]:
    """The parameter names (``model.*``, as ``PretrainModule`` holds the backbone) of each :func:`param_groups`
    group in order: what the numbered optimizer state of a checkpoint file refers to (found on a meta-device copy,
    whatever shards a strategy made of the live one)."""
    from pretrain.models.transformer import Transformer

    with torch.device("meta"):
        backbone = Transformer(model)
    names = {id(p): f"model.{n}" for n, p in backbone.named_parameters()}
    groups = param_groups(backbone, weight_decay, width_mult=model.width_mult, muon=muon)
    return [[names[id(p)] for p in g["params"]] for g in groups]


def lr_lambda(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` at optimizer step ``s`` (0-based).

    warmup:        (s + 1) / W                                     for s < W
    cosine:        m + (1 - m) * (1 + cos(pi * p)) / 2,  p = (s - W) / (D - W) clamped to [0, 1]
    linear:        m + (1 - m) * (1 - p)
    inverse_sqrt:  max(m, sqrt(W / (s + 1)))                       (T5 / fairseq)
    wsd:           1 until D - C, then m + (1 - m) * (D - s) / C,  C = cooldown_fraction * D
                   (warmup-stable-decay; Hu et al. 2024, "MiniCPM")
    constant:      1
    with W = warmup_steps, D = decay_steps (default max_steps), m = min_lr_ratio (checked by
    ``pretrain.config.run.check_optim``).
    """
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    decay_steps = cfg.decay_steps or max_steps
    cooldown = max(1, round(cfg.cooldown_fraction * decay_steps))

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        if cfg.schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if cfg.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        if cfg.schedule == "inverse_sqrt":
            return max(floor, math.sqrt(max(warmup, 1) / (step + 1)))
        if cfg.schedule == "wsd":
            return floor + (1.0 - floor) * min(1.0, max(0.0, (decay_steps - step) / cooldown))
        return 1.0

    return fn


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the ``muon`` groups and ``torch.optim.AdamW`` over the others, as one optimizer
    (Lightning's automatic optimization, one LR scheduler, one state dict). Both inner optimizers share this
    one's ``param_groups`` dicts and ``state``, so schedulers, guards, clipping and checkpoints see one
    optimizer.

    Sharded parameters (FSDP2 ``DTensor``s): Muon's Newton-Schulz iteration needs whole matrices; each step
    gathers the momentum-updated gradient of a sharded matrix, orthogonalises it in full on every rank and keeps
    the local shard -- the same update as one process (``_MuonGathered``).
    """

    def __init__(self, groups: list[dict[str, Any]], muon: dict[str, Any], adamw: dict[str, Any]) -> None:
        self.muon = _MuonGathered([g for g in groups if g["name"] == "muon"], **muon)
        self.adamw = torch.optim.AdamW([g for g in groups if g["name"] != "muon"], **adamw)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        self.muon.param_groups = [g for g in self.param_groups if g["name"] == "muon"]
        self.adamw.param_groups = [g for g in self.param_groups if g["name"] != "muon"]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # rebuilds param_groups and state: point the inner ones at them
        self._link()

    @property
    def skips_on_device(self) -> bool:
        """Whether ``step`` honours ``found_inf`` without reading it on the host (as a fused optimizer does):
        Muon selects on the device, AdamW needs its fused kernel."""
        return bool(self.adamw.defaults.get("fused")) and honours_found_inf(self.adamw)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Both inner steps; a ``found_inf`` attribute (a (,) device tensor, nonzero: skip the step, as
        GradScaler passes it to fused optimizers) leaves parameters and state as they were."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = getattr(self, "found_inf", None)
        if skip is None:
            self.muon.step()
            self.adamw.step()
            return loss
        self.muon.step(skip=skip)
        self.adamw.found_inf = skip  # type: ignore[attr-defined]  # read by the fused kernel (GradScaler's way)
        try:
            self.adamw.step()
        finally:
            del self.adamw.found_inf  # type: ignore[attr-defined]
        return loss


class _MuonGathered(torch.optim.Muon):
    """``torch.optim.Muon``, Newton-Schulz in ``ns_dtype`` (:mod:`pretrain.compat.muon`); a sharded
    (``DTensor``) matrix steps on its full gradient and parameter, gathered from the ranks, and writes its shard
    back. Non-sharded parameters take torch's own step unchanged."""

    def __init__(self, params: Any, ns_dtype: str = "auto", **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, skip: Tensor | None = None) -> Any:
        """torch's Muon step (Newton-Schulz in ``ns_dtype``). ``skip`` (a (,) device tensor, nonzero: skip) keeps
        every parameter and momentum buffer as it was, by selects on the device, so the host never waits for the
        verdict: the gradient is replaced by the buffer (which the momentum update then leaves as it is) and the
        orthogonalised update by zeros; with weight decay the matrices are also copied and put back. A step that
        is not skipped equals torch's bit for bit."""
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        if skip is None:
            with newton_schulz_dtype(resolve(self.ns_dtype, device)):
                return self._step(closure)
        skip = skip.bool()
        kept = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # as torch creates it
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                grad = _local(p.grad)
                torch.where(skip, _local(state["momentum_buffer"]), grad, out=grad)
                if group["weight_decay"]:
                    kept.append((p, _local(p).clone()))
        with newton_schulz_dtype(resolve(self.ns_dtype, device), zero_where=skip):
            out = self._step(closure)
        for p, before in kept:
            _local(p).copy_(torch.where(skip, before, _local(p)))
        return out

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        sharded = [p for g in self.param_groups for p in g["params"] if _is_dtensor(p) and p.grad is not None]
        if not sharded:
            return super().step(closure)
        from torch.distributed.tensor import distribute_tensor

        full = {}
        for p in sharded:  # step on full copies, in a throw-away view of the group
            state = self.state[p]
            q = nn.Parameter(p.full_tensor(), requires_grad=False)
            q.grad = p.grad.full_tensor()
            if "momentum_buffer" in state:
                self.state[q]["momentum_buffer"] = state["momentum_buffer"].full_tensor()
            full[p] = q
        saved = [g["params"] for g in self.param_groups]
        for g in self.param_groups:
            g["params"] = [full.get(p, p) for p in g["params"]]
        try:
            super().step(closure)
        finally:
            for g, params in zip(self.param_groups, saved, strict=True):
                g["params"] = params
        for p, q in full.items():
            place = (p.device_mesh, p.placements)
            p.copy_(distribute_tensor(q.detach(), *place, src_data_rank=None))
            buffer = self.state.pop(q)["momentum_buffer"]
            self.state[p]["momentum_buffer"] = distribute_tensor(buffer, *place, src_data_rank=None)
        return None


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t`` (its shard, for a ``DTensor``), writable in place."""
    return cast("DTensor", t).to_local() if _is_dtensor(t) else t


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    cpu_offload: bool = False,
    amp: bool = False,
    width_mult: float = 1.0,
    extra_groups: Sequence[dict[str, Any]] = (),
) -> torch.optim.Optimizer:
    """AdamW (fused) over :func:`param_groups`, or :class:`MuonWithAdamW` for ``cfg.name == "muon"``; DeepSpeed's
    CPU Adam when ZeRO offloads the optimizer to the CPU. ``width_mult``: muP's m (``ModelConfig.width_mult``).
    ``amp`` (a ``*-mixed`` precision): not fused, since Lightning's AMP plugin refuses to clip gradients for an
    optimizer that unscales them itself (a fused one). ``extra_groups``: AdamW groups of parameters outside
    ``model`` with their own ``lr`` (finetuning's task head); empty groups are dropped."""
    muon = cfg.name == "muon"
    groups = param_groups(model, cfg.weight_decay, width_mult=width_mult, muon=muon)
    for g in groups:
        if g["name"] == "muon":
            g["lr"], g["weight_decay"] = cfg.muon.lr * g["lr_mult"], cfg.muon.weight_decay
        else:
            g["lr"] = cfg.lr * g["lr_mult"]
    groups = [g for g in [*groups, *extra_groups] if g["params"]]
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # the fused kernel (CUDA, and CPU since torch 2.4) updates all tensors in one pass: 3x faster than the
    # per-tensor loop torch picks on the CPU by default (9 -> 3 ms per step for the 1M-parameter tiny GPT)
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = not amp and devices in ({"cuda"}, {"cpu"})
    if not muon:
        return torch.optim.AdamW(groups, fused=fused or None, **kwargs)
    if not any(
        g["name"] == "muon" for g in groups
    ):  # torch's "optimizer got an empty parameter list" traceback
        raise InputError(
            f"optim.name=muon: {type(model).__name__} has no weight matrices Muon trains (the hidden 2-D weights "
            "pretrain.optim.param_groups gives it; embeddings, norms and heads go to AdamW); use optim.name=adamw"
        )
    m = cfg.muon
    muon_kwargs = {
        "lr": m.lr,
        "momentum": m.momentum,
        "nesterov": m.nesterov,
        "ns_steps": m.ns_steps,
        "weight_decay": m.weight_decay,
        "adjust_lr_fn": m.adjust_lr,
        "ns_dtype": m.ns_dtype,
    }
    return MuonWithAdamW(groups, muon_kwargs, {**kwargs, "fused": fused or None})


def describe(optimizer: torch.optim.Optimizer) -> str:
    """One line per parameter group: name, tensors, parameters, learning rate, weight decay."""
    kind = "muon" if isinstance(optimizer, MuonWithAdamW) else "adamw"
    lines = [f"optimizer {kind}: parameter groups (pretrain.optim.param_groups)"]
    for g in optimizer.param_groups:
        name = g.get("name", "?")
        algo = "muon" if name == "muon" else "adamw"
        numel = sum(p.numel() for p in g["params"])
        lines.append(
            f"  {name:<9} {algo:<5} {len(g['params']):>4} tensors {numel:>12,} params  "
            f"lr {g['lr']:.3g}  weight_decay {g['weight_decay']:.3g}"
        )
    return "\n".join(lines)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, max_steps))
