"""Tokens/s and model FLOP utilisation, measured without a per-step device synchronisation, with a *dense* peak
table.

MFU = (achieved model FLOP/s per device) / (dense peak FLOP/s of the device at the compute dtype), with the model
FLOPs from the backbone's analytic ``flops_per_token`` (6N + attention, forward + backward; PaLM appendix B).
Lightning's own table mixes dense and 2:4-sparse figures (e.g. H200, H100 NVL), which halves MFU on those chips;
this table lists dense tensor-core numbers from the NVIDIA datasheets. CPUs have no entry: MFU is omitted there
unless ``trainer.peak_flops`` gives one.

``PeakThroughputMonitor`` logs what Lightning's ``ThroughputMonitor`` logs (``train/time``, ``train/lengths``,
``train/device/items_per_sec``, ``train/device/mfu``, ...: Lightning's ``Throughput`` over the last
``window_size`` micro-batches), but that one calls ``torch.cuda.synchronize()`` after every batch to read the
clock. Here each batch end on CUDA is an event; the events become host times at the next logging step, after
one wait for the newest (``t_i = now - elapsed(e_i, e_last)``), so the times are the device's and a step that
does not log never waits. On the CPU the host clock is read directly. Validation time is not training time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from pretrain.training import lightning_compat

# name fragment (matched in order against the lower-cased CUDA device name) -> dense peak FLOP/s per dtype
DENSE_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("b200", {"bf16": 2250e12, "tf32": 1100e12, "fp32": 75e12}),
    ("h200 nvl", {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM; also GH200
    ("h100 nvl", {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h100 pcie", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("h100", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM (HBM3)
    ("a100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("l40s", {"bf16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("l4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("a6000", {"bf16": 154.8e12, "tf32": 77.4e12, "fp32": 38.7e12}),
    ("a10g", {"bf16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    ("v100", {"fp16": 125e12, "fp32": 15.7e12}),
]


def _dtype_key(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype is torch.bfloat16 else "fp16"
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a Lightning precision setting (``bf16-mixed`` -> bfloat16, ``32-true`` -> float32)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one ``device`` at compute ``dtype``; ``None`` when unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    key = _dtype_key(dtype)
    for fragment, table in DENSE_PEAK_FLOPS:
        if fragment in name:
            if key == "fp16" and "fp16" not in table:
                key = "bf16"
            if key == "bf16" and "bf16" not in table:
                key = "fp16"
            return table.get(key)
    return None


class PeakThroughputMonitor(Callback):
    """Training throughput and MFU (module docstring) from ``batch_size_fn(batch)`` samples, ``length_fn(batch)``
    tokens and the module's ``flops_per_batch`` per micro-batch; the peak from :data:`DENSE_PEAK_FLOPS` unless
    ``peak`` (FLOP/s per device) is given. Rank 0 measures and logs, as Lightning's monitor does."""

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int],
        window_size: int,
        peak: float | None = None,
    ) -> None:
        self.batch_size_fn, self.length_fn, self.window_size, self.peak = batch_size_fn, length_fn, window_size, peak
        self.throughput: Throughput | None = None
        self._pending: deque[tuple[Any, int, int, int, float]] = deque(maxlen=window_size)
        self._t0 = self._validation_start = 0.0
        self._totals = [0, 0, 0]  # batches, samples, tokens since train start

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        available = self.peak or peak_flops(trainer.strategy.root_device, compute_dtype(str(trainer.precision)))
        self.throughput = Throughput(
            available_flops=available, world_size=trainer.world_size, window_size=self.window_size
        )

    @rank_zero_only
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.throughput is not None
        self.throughput.reset()
        self._pending.clear()
        self._totals = [0, 0, 0]
        self._t0 = time.perf_counter()

    @rank_zero_only
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.strategy.root_device.type == "cuda":
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        totals = self._totals
        totals[0] += 1
        totals[1] += self.batch_size_fn(batch)
        totals[2] += self.length_fn(batch)
        self._pending.append((mark, *totals, float(pl_module.flops_per_batch)))
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and lightning_compat.should_update_logs(trainer):
            self._flush()
            assert self.throughput is not None
            metrics = {f"train/{k}": v for k, v in self.throughput.compute().items()}
            lightning_compat.log_metrics(trainer, metrics)

    def _flush(self) -> None:
        """Feed the pending batch ends to ``Throughput``, as seconds since train start (one wait on CUDA)."""
        if not self._pending:
            return
        last = self._pending[-1][0]
        if isinstance(last, torch.cuda.Event):
            last.synchronize()
        now = time.perf_counter() - self._t0
        assert self.throughput is not None
        for mark, batches, samples, tokens, flops in self._pending:
            at = now - mark.elapsed_time(last) / 1e3 if isinstance(mark, torch.cuda.Event) else mark - self._t0
            self.throughput.update(time=at, batches=batches, samples=samples, lengths=tokens, flops=flops)
        self._pending.clear()

    @rank_zero_only
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit":
            self._flush()
            self._validation_start = time.perf_counter()

    @rank_zero_only
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit":
            self._t0 += time.perf_counter() - self._validation_start  # the clock stops during validation
