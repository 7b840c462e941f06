"""Host-device synchronisation on the training hot path: the one kind of read it does, and the check that it
does no other (``trainer.sync_check: off | warn | error``).

Every ``.item()``, ``bool(t)``, ``.tolist()``, data-dependent shape (``nonzero``, boolean-mask indexing) or
device-to-host copy makes the host wait until the device has run everything queued before it: the queue drains
and the device idles while the host launches the next kernels. A step that does not log does none of them:

- ``DeferredRead`` copies a device tensor into pinned host memory without blocking and records an event; its
  ``read`` (at the end of the step) waits for that event only -- work queued after it (the optimizer update)
  keeps the device busy meanwhile. The guards' verdict and the stop-signal agreement are read this way.
- ``SyncCheck`` checks it, on steps that do not log, from after the batch transfer (the first
  ``on_train_batch_start``) to the end of the step's callbacks (the last ``on_train_batch_end``). On CUDA the
  window runs under ``torch.cuda.set_sync_debug_mode``; elsewhere ``HostReadMode``, a ``TorchFunctionMode``,
  sees every such call made from Python (ops inside compiled graphs or C++ are not seen). ``error`` raises
  ``HostSyncError`` naming the op and the file:line that called it; ``warn`` warns once per op and line.
- Work that syncs by nature (a checkpoint save, a guard snapshot) runs inside :func:`allowed`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from types import FrameType
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.overrides import TorchFunctionMode

from pretrain.training.step import starts_step

SyncCheckMode = Literal["off", "warn", "error"]

# torch functions that read a tensor's values on the host, or whose output shape depends on them
_HOST_READS = {
    Tensor.item: "Tensor.item()",
    Tensor.tolist: "Tensor.tolist()",
    Tensor.__bool__: "bool(tensor)",
    Tensor.__int__: "int(tensor)",
    Tensor.__float__: "float(tensor)",
    Tensor.__index__: "tensor as an index",
    Tensor.__format__: "formatting a tensor",
    Tensor.numpy: "Tensor.numpy()",
    Tensor.cpu: "Tensor.cpu()",
    Tensor.nonzero: "Tensor.nonzero()",
    torch.nonzero: "torch.nonzero()",
    Tensor.masked_select: "Tensor.masked_select()",
    torch.masked_select: "torch.masked_select()",
    torch.unique: "torch.unique()",
    Tensor.unique: "Tensor.unique()",
}
_TORCH_DIR = os.path.dirname(torch.__file__)
_active: list[HostReadMode] = []  # the checking mode of this process, while a window is open


class HostSyncError(RuntimeError):
    """A host read of device values on a step that must not wait for the device."""


# copies: torch's own calls of these move to the tensors' device, never to host
_COPIES = (Tensor.cpu, Tensor.numpy, Tensor.to)


def _caller(skip_torch: bool = True) -> str | None:
    """file:line of the innermost frame outside this module (and outside torch); None for a torch frame."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    while skip_torch and frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _host_read(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name of the host read ``func(*args, **kwargs)`` is, or None."""
    name = _HOST_READS.get(func)
    if name is not None:
        return name
    if func is Tensor.__getitem__ and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index):
            return "boolean-mask indexing"
    if func is Tensor.to:  # named "cpu"; a torch.device is the compute device (here the CPU itself)
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, str)), None))
        if isinstance(target, str) and target.startswith("cpu"):
            return "Tensor.to('cpu')"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(condition)"
    return None


class HostReadMode(TorchFunctionMode):
    """Counts host reads by (op, file:line); ``error`` raises on the first, ``warn`` warns once per site."""

    def __init__(self, mode: SyncCheckMode, step: int = -1):
        super().__init__()
        self.mode, self.step = mode, step
        self.counts: Counter[tuple[str, str]] = Counter()
        self.paused = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and (op := _host_read(func, args, kwargs)) is not None:
            site = _caller(skip_torch=func not in _COPIES)
            if site is None:
                return func(*args, **kwargs)
            self.counts[op, site] += 1
            message = (
                f"{op} at {site} waits for the device on step {self.step}, which does not log "
                f"(trainer.sync_check={self.mode}; read values on logging steps, or copy them with "
                f"pretrain.training.callbacks.host_sync.DeferredRead)"
            )
            if self.mode == "error":
                raise HostSyncError(message)
            if self.counts[op, site] == 1:
                warnings.warn(message, stacklevel=2)
        return func(*args, **kwargs)


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    """Host reads that belong to the step by design (a checkpoint save, a snapshot, a deferred read)."""
    mode = _active[-1] if _active else None
    cuda = torch.cuda.is_available() and torch.cuda.get_sync_debug_mode() != 0
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    if mode is not None:
        mode.paused += 1
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode is not None:
            mode.paused -= 1
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)


class DeferredRead:
    """``value`` (a small device tensor) copied to the host without blocking; ``read()`` returns it as a list,
    waiting for the copy only (recorded before whatever the device was given after it)."""

    def __init__(self, value: Tensor):
        value = value.detach()
        self._event = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = value.to("cpu", non_blocking=True) if value.device.type != "cpu" else value.clone()

    def read(self) -> Any:
        """The value as ``Tensor.tolist`` gives it: a number for a (,) tensor, else a (nested) list."""
        if self._event is not None:
            self._event.synchronize()
        with allowed():
            return self._host.tolist()


class SyncCheck(Callback):
    """``trainer.sync_check``: no host read of device values on a step that does not log (module docstring).
    ``counts`` holds, per (op, file:line), the reads seen over the run (``warn`` mode)."""

    def __init__(self, mode: SyncCheckMode):
        if mode not in ("warn", "error"):
            raise ValueError(f"trainer.sync_check must be off, warn or error, got {mode!r}")
        self.mode = mode
        self.counts: Counter[tuple[str, str]] = Counter()
        self.checked_steps = 0
        self._window: HostReadMode | None = None
        self._cuda = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """First among the callbacks (opens the window), and a closer last among them."""
        callbacks = [cb for cb in trainer.callbacks if cb is not self and not isinstance(cb, _CloseWindow)]
        trainer.callbacks[:] = [self, *callbacks, _CloseWindow(self)]
        self._cuda = trainer.strategy.root_device.type == "cuda"

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from pretrain.compat.lightning import should_update_logs

        if should_update_logs(trainer):  # a logging step may read its metrics back
            return
        self.checked_steps += starts_step(batch_idx, trainer.accumulate_grad_batches)
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self.mode)
        self._window = HostReadMode(self.mode, trainer.global_step)
        self._window.__enter__()
        _active.append(self._window)

    def close(self) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode(0)
        if self._window is not None:
            _active.remove(self._window)
            self._window.__exit__(None, None, None)
            self.counts.update(self._window.counts)
            self._window = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.close()
        if stage == "fit":
            reads = ", ".join(f"{n}x {op} at {site}" for (op, site), n in self.counts.most_common()) or "none"
            rank_zero_info(
                f"trainer.sync_check={self.mode}: {self.checked_steps} steps that do not log checked "
                f"(rank {trainer.global_rank}); host reads: {reads}"
            )


class _CloseWindow(Callback):
    """The last ``on_train_batch_end``: closes ``SyncCheck``'s window."""

    def __init__(self, check: SyncCheck):
        self.check = check

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.check.close()
