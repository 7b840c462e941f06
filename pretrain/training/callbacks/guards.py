"""Guards for unattended runs: non-finite steps, loss spikes and hangs (config section ``guards``).

``StepGuard`` (a Lightning callback) looks at every optimizer step after the backward pass, before the update,
and decides on the device -- a step that does not log never waits for it (``host_sync.py``):

- the step's loss terms (``StepLoss``: ``sum_m S_m`` of this rank, the global target count N) and a non-finite
  flag (any gradient NaN/Inf on this rank) are all-reduced in one collective, so every rank (DDP, FSDP shards)
  takes the same decision; ``L = sum_{r,m} S_{r,m} / N``;
- a non-finite step is not applied: the fused optimizer gets ``found_inf`` (GradScaler's mechanism), so AdamW
  leaves the weights, its moments and step counts untouched, and Muon keeps its matrices and momentum by
  selects on the device (``MuonWithAdamW.skips_on_device``; the learning-rate schedule and the step counter
  still advance). An optimizer without that input (not fused: ``*-mixed`` precisions, CPU offload) has its
  gradients dropped instead, which reads the verdict on the host;
- a spike is ``L > mean + k * std`` of the last ``window`` normal losses, ``m`` steps in a row (PaLM, Chowdhery
  et al. 2022, section 5.1: restart ~100 steps before the spike and skip the batches in between); the threshold
  and the streak are host numbers known before the step, so the m-th spike step is skipped on the device too;
- ``L`` and the flag come back to the host with a ``DeferredRead`` and are acted on at the end of the step (the
  update then is still running on the device): the loss history, streaks, events, and the rollback after ``m``
  spike steps or ``nonfinite.max_consecutive`` non-finite ones. A rollback puts the weights and optimizer state
  of the last good snapshot back and skips the samples read since it (the window that led to the spike) -- the
  data position is not rewound. Optionally the learning rate is scaled for a while.

Snapshots are host-memory copies of the parameters, buffers and optimizer state, taken at train start, at every
checkpoint and every ``snapshot_every`` steps, and only while no anomaly is running; the copy runs in a thread
while the next forward and backward pass run, and the next optimizer step waits for it. The guard's state (loss
history, streaks, events with the skipped sample positions) is saved in every checkpoint; the snapshot too when
it is older than the checkpoint, so a resumed run makes the same decisions as an uninterrupted one.

``HangGuard`` gives every batch a deadline: if it does not finish within ``max(min_seconds, factor * median of
the recent batch times)`` (``startup_seconds`` for the first ones), a watchdog thread writes all Python stacks of
the rank to ``<run_dir>/hang-rank<r>.txt`` and exits with status 1 -- it works while the main thread is blocked
inside a collective. A batch costs the main thread one clock read (no timer re-armed per batch). The process
group timeout is set above it.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from pretrain.checkpoint.async_save import TensorKey, tensor_key
from pretrain.compat.dtensor import local_shard
from pretrain.compat.optim import honours_found_inf
from pretrain.config.run import GuardsConfig, HangGuardConfig
from pretrain.optim import wait_before_update
from pretrain.training.callbacks.host_sync import DeferredRead, allowed
from pretrain.training.step import StepLossHooks, ends_step


def _cpu_copy(obj: Any, into: Any = None, copies: dict[TensorKey, Tensor] | None = None) -> Any:
    """A deep copy of nested dicts/lists/tuples in which every tensor is cloned to host memory -- into the host
    tensor at the same place of ``into`` (an earlier copy) where it has the same shape and dtype: a snapshot
    every checkpoint then re-uses its memory instead of faulting in a model's worth of fresh pages. ``copies``
    gets each copy by its source's ``tensor_key``."""
    if isinstance(obj, Tensor):
        if isinstance(into, Tensor) and into.shape == obj.shape and into.dtype == obj.dtype:
            copy = into.copy_(obj.detach())
        else:
            copy = obj.detach().to("cpu", copy=True)
        if copies is not None:
            copies[tensor_key(obj)] = copy
        return copy
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _cpu_copy(v, into.get(k), copies) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_cpu_copy(v, w, copies) for v, w in zip(obj, into, strict=True))
    return obj


def _host_buffers(obj: Any) -> Any:
    """``obj`` with every plain tensor replaced by host memory of its shape and dtype, paged in (zeros): what
    ``_cpu_copy`` copies it into later. DTensors (``None``) are copied into fresh memory."""
    if isinstance(obj, Tensor):
        return None if local_shard(obj) is not obj else torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _host_buffers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_buffers(v) for v in obj)
    return obj


def _nonfinite(norm: Tensor | None, device: torch.device) -> Tensor:
    """1.0 where the gradient norm of this rank (its shard's under FSDP) is NaN/Inf, else 0.0; (,) on the device."""
    if norm is None:  # DeepSpeed keeps its gradients inside the engine; the loss is still checked
        return torch.zeros((), device=device)
    local = norm.to_local() if hasattr(norm, "to_local") else norm
    return (~local.isfinite()).float()


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` tensor: the fused Adam/AdamW/SGD kernels, and an
    optimizer that says so (``skips_on_device``: ``MuonWithAdamW``)."""
    own = getattr(optimizer, "skips_on_device", None)
    if own is not None:
        return bool(own)
    return honours_found_inf(optimizer) and bool(optimizer.defaults.get("fused"))


class StepGuard(Callback):
    """Skips non-finite steps and rolls back loss spikes (see the module docstring)."""

    def __init__(self, config: GuardsConfig):
        self.config = config
        self.history: deque[float] = deque(maxlen=config.spike.window)
        self.spike_streak = self.nonfinite_streak = 0
        self.nonfinite_steps = self.rollbacks = 0
        self.lr_steps_left = 0
        self.events: list[dict[str, Any]] = []
        self.snapshot: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None
        # (step, data position, verdict) of the step being decided
        self._pending: tuple[int, tuple[int, int], DeferredRead] | None = None
        self._lr_scaled: list[tuple[float, float]] | None = None
        self._copier: ThreadPoolExecutor | None = None  # the snapshot's copy (``_take_snapshot``)
        self._copying: Future | None = None
        self._copies: dict[TensorKey, Tensor] = {}  # the snapshot's copies by their source (``host_copies``)
        self._spare: Future | None = None  # host memory for the first copy of the optimizer state
        self._spared = False
        self._lent: Future | None = None  # done once a checkpoint write no longer reads the snapshot
        self._hooked: set[int] = set()

    # ------------------------------------------------------------------------------------------ state
    @property
    def state_key(self) -> str:
        return "StepGuard"

    def state_dict(self) -> dict[str, Any]:
        """Statistics, streaks and events; the snapshot only when it is older than the checkpoint (the
        resumed run re-takes one from the loaded state otherwise)."""
        trainer = self._trainer
        if trainer is not None and trainer.training:
            self._take_snapshot(trainer)
        state = {
            "history": list(self.history),
            "spike_streak": self.spike_streak,
            "nonfinite_streak": self.nonfinite_streak,
            "nonfinite_steps": self.nonfinite_steps,
            "rollbacks": self.rollbacks,
            "lr_steps_left": self.lr_steps_left,
            "events": list(self.events),
        }
        if (
            self.snapshot is not None
            and trainer is not None
            and (trainer.world_size == 1 or _replicated(trainer))  # a shard of rank 0 is no use to others
            and self.snapshot["step"] != trainer.global_step
        ):
            self._settle()  # (the copy of an older snapshot; the one just started is not saved)
            state["snapshot"] = self.snapshot
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.config.spike.window)
        for key in ("spike_streak", "nonfinite_streak", "nonfinite_steps", "rollbacks", "lr_steps_left"):
            setattr(self, key, int(state[key]))
        self.events = list(state["events"])
        self._settle()
        self.snapshot = state.get("snapshot")
        self._copies = {}

    # ------------------------------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.snapshot is None:
            self._take_snapshot(trainer, force=True)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """The verdict on the device: all-reduce (sum_m S_m, non-finite flag), skip the update where due."""
        # every module's (training.step.StepLossHooks): made at train start, begun by the step's first micro-batch
        assert isinstance(pl_module, StepLossHooks) and pl_module.step_loss is not None
        step = pl_module.step_loss
        assert step.loss_sum is not None and step.num_targets is not None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        flags = torch.stack([step.loss_sum, _nonfinite(step.grad_norm(params), step.loss_sum.device)])
        if trainer.world_size > 1:
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        loss = flags[0] / step.num_targets.clamp_min(1)
        bad = (flags[1] > 0) | ~loss.isfinite()
        skip = bad if self._check_nonfinite(trainer) else None
        spike = self.config.spike
        if spike.enabled and len(self.history) >= spike.min_history and self.spike_streak + 1 >= spike.m:
            spiked = loss.double() > self._threshold()  # the m-th spike in a row: rolled back, not applied
            skip = spiked if skip is None else skip | spiked
        if skip is not None and _skips_on_device(optimizer):
            # read by the fused kernel (as GradScaler passes it); torch's Optimizer does not declare the attribute
            optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
        elif skip is not None and bool(skip):  # no device-side skip: this reads the verdict on the host
            self._drop_update(params)
        verdict = DeferredRead(torch.stack([loss.double(), bad.double()]))
        # the step's number counted from 1 (global_step once it has stepped), as its metrics are logged at
        self._pending = (trainer.global_step + 1, _data_position(trainer), verdict)
        if self.lr_steps_left > 0:  # counted down once the step turns out normal
            self._lr_scaled = [
                (group["lr"], group["lr"] * spike.lr_factor) for group in optimizer.param_groups
            ]
            for group, (_, scaled) in zip(optimizer.param_groups, self._lr_scaled):
                group["lr"] = scaled

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """After the update: back to the schedule's learning rate (unless the scheduler has set the next one
        already); act on the step's verdict; snapshot."""
        optimizer = trainer.optimizers[0]
        if self._lr_scaled is not None:
            for group, (lr, scaled) in zip(optimizer.param_groups, self._lr_scaled):
                if group["lr"] == scaled:
                    group["lr"] = lr
            self._lr_scaled = None
        if hasattr(optimizer, "found_inf"):
            del optimizer.found_inf
        self._resolve(trainer, pl_module)
        if not ends_step(idx, trainer.accumulate_grad_batches):
            return
        every = self.config.snapshot_every
        if every and trainer.global_step % every == 0:
            with allowed():  # a copy of every weight to the host
                self._take_snapshot(trainer)
        if self._spare is None and not self._spared and self._copier is not None and self._copying is None:
            self._spared = True
            if self.snapshot is not None and not any(
                s.get("state") for s in self.snapshot.get("optimizers", [])
            ):
                # a fresh run's snapshot (from before the first step) holds no optimizer state: the memory its
                # next copy needs is paged in now, off this thread, not at the first checkpoint's step
                states = [opt.state_dict() for opt in trainer.optimizers]
                self._spare = self._copier.submit(_host_buffers, states)

    def _check_nonfinite(self, trainer: L.Trainer) -> bool:
        """Non-finite steps are skipped here unless 16-mixed's loss scaler skips them itself."""
        return self.config.nonfinite.enabled and getattr(trainer.precision_plugin, "scaler", None) is None

    def _resolve(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The host side of the last step's verdict (its update was skipped on the device where due)."""
        if self._pending is None:
            return
        step, position, verdict = self._pending
        self._pending = None
        loss, bad = verdict.read()
        optimizer = trainer.optimizers[0]
        if self._check_nonfinite(trainer) and bad:
            self.nonfinite_steps += 1
            self.nonfinite_streak += 1
            self._record(trainer, {"step": step, "event": "nonfinite", "loss": loss})
            if self.nonfinite_streak >= self.config.nonfinite.max_consecutive:
                self._rollback(trainer, pl_module, optimizer, step, loss, "nonfinite", position)
            return
        self.nonfinite_streak = 0
        spike = self.config.spike
        if spike.enabled:
            if len(self.history) >= spike.min_history and loss > self._threshold():
                self.spike_streak += 1
                if self.spike_streak >= spike.m:
                    self._rollback(trainer, pl_module, optimizer, step, loss, "spike", position)
                    return
            else:
                self.spike_streak = 0
                self.history.append(loss)
        if self.lr_steps_left > 0:
            self.lr_steps_left -= 1

    # ------------------------------------------------------------------------------------------ helpers
    def _threshold(self) -> float:
        mean = statistics.fmean(self.history)
        return mean + self.config.spike.k * statistics.pstdev(self.history, mean)

    @staticmethod
    def _drop_update(params: list[Tensor]) -> None:
        for p in params:
            p.grad = None

    def _take_snapshot(self, trainer: L.Trainer, force: bool = False) -> None:
        """Copy the weights, buffers, optimizer state and data position -- unless an anomaly is running. The
        copy runs in a thread of its own while the next forward and backward pass run (they only read what it
        copies); the next optimizer step waits for it (``_settle``), as does anything that reads the snapshot."""
        if not force and (self.spike_streak or self.nonfinite_streak):
            return
        if self.snapshot is not None and self.snapshot["step"] == trainer.global_step:
            return
        self._settle()
        # the last snapshot's memory is re-used, unless a checkpoint is still being written from it
        old = self.snapshot if self._lent is None or self._lent.done() else None
        old = old or {}
        previous = list(old.get("optimizers", [])) + [None] * len(trainer.optimizers)
        spare, self._spare = self._spare, None
        model = _local_tensors(trainer.lightning_module)
        optimizers = [opt.state_dict() for opt in trainer.optimizers]
        copies: dict[TensorKey, Tensor] = {}
        self._copies = copies

        def copy() -> dict[str, Any]:
            into = spare.result() + previous if spare is not None else previous
            return {
                "model": _cpu_copy(model, old.get("model"), copies),
                "optimizers": [_cpu_copy(state, p, copies) for state, p in zip(optimizers, into)],
            }

        self.snapshot = {"step": trainer.global_step, "position": _data_position(trainer)}
        if not self._copies_in_background(trainer):
            self.snapshot.update(copy())
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pretrain-guard-snapshot")
        self._copying = self._copier.submit(copy)

    def host_copies(self, release: Future) -> Callable[[], dict[TensorKey, Tensor]] | None:
        """For a checkpoint of the current training state (``AsyncCheckpointWriter.host_copies``): the snapshot's
        host copies by their source's ``tensor_key`` (the function waits for the copy in flight), when the snapshot
        is of this state (taken at this step, in training); None otherwise. Its memory is not re-used until
        ``release`` is done."""
        trainer = self._trainer
        if (
            self.snapshot is None
            or trainer is None
            or not trainer.training
            or self.snapshot["step"] != trainer.global_step
        ):
            return None
        self._lent = release
        copying, copies = self._copying, self._copies
        if copying is None:
            return lambda: copies
        return lambda: (copying.result(), copies)[1]

    def _copies_in_background(self, trainer: L.Trainer) -> bool:
        """Whether every optimizer is a ``torch.optim.Optimizer`` (its update then waits for the copy:
        ``wait_before_update``); DeepSpeed updates inside its engine: copied on the training thread."""
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(trainer.strategy, DeepSpeedStrategy) or not all(
            isinstance(opt, torch.optim.Optimizer) for opt in trainer.optimizers
        ):
            return False
        for opt in trainer.optimizers:
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                wait_before_update(opt, self._settle)
        return True

    def _settle(self) -> None:
        """Wait for the snapshot's copy in flight, if any (training thread)."""
        copying, self._copying = self._copying, None
        if copying is not None:
            assert self.snapshot is not None
            self.snapshot.update(copying.result())

    def _rollback(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        optimizer: torch.optim.Optimizer,
        step: int,
        loss: float,
        reason: str,
        position: tuple[int, int],
    ) -> None:
        if self.rollbacks >= self.config.max_rollbacks:
            raise RuntimeError(
                f"step {step}: {reason} after {self.rollbacks} rollbacks (guards.max_rollbacks); the run cannot "
                f"recover by itself -- lower optim.lr, check the data, or raise guards.max_rollbacks"
            )
        self._settle()
        assert self.snapshot is not None
        snap = self.snapshot
        with torch.no_grad(), allowed():
            for name, tensor in _local_tensors(pl_module).items():
                tensor.copy_(snap["model"][name])
        for opt, state in zip(trainer.optimizers, snap["optimizers"]):
            lrs = [group["lr"] for group in opt.param_groups]  # the schedule goes on
            opt.load_state_dict(_cpu_copy(state))  # a copy: the optimizer keeps host tensors it is given
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
        self.rollbacks += 1
        self.spike_streak = self.nonfinite_streak = 0
        self.lr_steps_left = self.config.spike.lr_steps if self.config.spike.lr_factor < 1 else 0
        start, end = snap["position"], position
        self._record(
            trainer,
            {
                "step": step,
                "event": f"rollback_{reason}",
                "loss": loss,
                "to_step": snap["step"],
                "skipped_samples": [start, end],  # [(epoch, consumed samples) at the snapshot, now)
            },
        )

    def _record(self, trainer: L.Trainer, event: dict[str, Any]) -> None:
        """Keep the event (saved in checkpoints), warn, and send it to every logger (W&B, CSV)."""
        self.events.append(event)
        if not trainer.is_global_zero:
            return
        rank_zero_warn(f"guards: {event}")
        metrics = {"guard/loss": event["loss"], "guard/nonfinite_steps": self.nonfinite_steps}
        if "to_step" in event:
            (e0, s0), (e1, s1) = event["skipped_samples"]
            metrics.update(
                {
                    "guard/rollbacks": self.rollbacks,
                    "guard/rollback_to_step": event["to_step"],
                    "guard/skipped_from_epoch": e0,
                    "guard/skipped_from_sample": s0,
                    "guard/skipped_to_epoch": e1,
                    "guard/skipped_to_sample": s1,
                }
            )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=event["step"])


def _local_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """This rank's parameters and buffers by name (the local shards under FSDP; no collective)."""
    return {n: t.data for n, t in [*module.named_parameters(), *module.named_buffers()]}


def _data_position(trainer: L.Trainer) -> tuple[int, int]:
    """(epoch, global samples consumed in it) of the training stream (``PretrainDataModule``), else (0, 0)."""
    data = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's DataConnector, not declared
    return int(getattr(data, "epoch", 0)), int(getattr(data, "consumed_samples", 0))


def _replicated(trainer: L.Trainer) -> bool:
    from lightning.pytorch.strategies import DDPStrategy

    return type(trainer.strategy) is DDPStrategy


class HangGuard(Callback):
    """Dumps every thread's Python stack and exits with status 1 when a batch takes far longer than usual.

    A batch start is one float written on the main thread (its deadline); a watchdog thread sleeps until the
    deadline (at most a second at a time, so a shortened timeout applies soon) and, when it passes with no new
    batch begun, writes ``Timeout (H:MM:SS)!`` and the stacks of all threads (``faulthandler.dump_traceback``) to
    ``<run_dir>/hang-rank<r>.txt`` and ends the process (``os._exit(1)``). It runs while the main thread waits
    in a collective, a device synchronisation, a lock or a sleep: all of them release the GIL."""

    RECENT = 20  # batch durations in the median
    POLL = 1.0  # longest sleep of the watchdog, seconds

    def __init__(self, config: HangGuardConfig, run_dir: str | Path):
        self.config, self.run_dir = config, Path(run_dir)
        self.durations: deque[float] = deque(maxlen=self.RECENT)
        self._last: float | None = None
        self._deadline: tuple[float, float] | None = None  # (monotonic deadline, its timeout): one assignment
        self._rank = 0
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def timeout(self) -> float:
        c = self.config
        if len(self.durations) < 3:
            return c.startup_seconds
        return max(c.min_seconds, c.factor * statistics.median(self.durations))

    def _arm(self, trainer: L.Trainer) -> None:
        timeout = self.timeout()
        self._deadline = (time.monotonic() + timeout, timeout)
        if self._watchdog is None:
            self._rank = trainer.global_rank
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="pretrain-hang-guard", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            armed = self._deadline
            if armed is None:
                self._stop.wait(self.POLL)
                continue
            left = armed[0] - time.monotonic()
            if left <= 0 and self._deadline is armed:  # no batch began since: hung
                self._dump(armed[1])
            self._stop.wait(min(max(left, 0.0), self.POLL))

    def _dump(self, timeout: float) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / f"hang-rank{self._rank}.txt", "w") as file:
            file.write(f"Timeout ({timedelta(seconds=timeout)})!\n")
            faulthandler.dump_traceback(file, all_threads=True)
        os._exit(1)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.durations.append(now - self._last)
        self._last = now
        self._arm(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._arm(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation time is not a training batch's

    def _disarm(self) -> None:
        self._deadline = None
        if self._watchdog is not None:
            self._stop.set()
            self._watchdog.join()
            self._watchdog = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._disarm()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._disarm()


def build_guards(run: Any) -> list[Callback]:
    """The guards ``run.guards`` enables (a ``RunConfig``). Under DeepSpeed the engine owns the gradients and
    optimizer state, so only the hang guard applies (its fp16 loss scaler skips overflowing steps itself)."""
    g = run.guards
    callbacks: list[Callback] = []
    if (g.nonfinite.enabled or g.spike.enabled) and run.strategy.name != "deepspeed":
        callbacks.append(StepGuard(g))
    if g.hang.enabled:
        callbacks.append(HangGuard(g.hang, run.run_dir))
    return callbacks
