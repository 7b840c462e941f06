"""Tokens/s and model FLOP utilisation, measured without a per-step device synchronisation, with a *dense* peak
table.

    MFU = achieved model FLOP/s per device / dense peak FLOP/s of the device at the compute dtype

FLOP convention (:data:`MFU_CONVENTION`, torchtitan's and PaLM appendix B's): per token of training,

    6 N + 12 L d T      (N: matmul weights incl. the LM head, L layers, d = h d_h attention width, T tokens)

exactly as ``Transformer.flops_per_token`` counts it, forward + backward, no causal halving of the attention
term (SDPA/FlashAttention compute the masked tiles' work anyway) and no recomputation counted. Megatron-LM's
``num_floating_point_operations`` halves the causal attention term, 6 N + 6 L d T, so its MFU is lower by
6 L d T / (6 N + 12 L d T) (6.6 % for GPT-2 124M at T = 1024, 13 % at T = 2048 for d = 768); compare only
numbers of one convention.

The peak table is a pure function of (device name, dtype) (:func:`peak_for`): dense tensor-core figures from
the vendors' datasheets (their "with sparsity" figures halved). Lightning's own table mixes dense and 2:4-sparse
figures (e.g. H200, H100 NVL), which halves MFU on those chips. A GPU that is not in the table logs no MFU and
warns once, a CPU logs none silently, unless ``trainer.peak_flops`` gives the peak -- never a wrong number.

``PeakThroughputMonitor`` logs what Lightning's ``ThroughputMonitor`` logs, under names that say what they are
(``NAMES``: ``train/seconds``, ``train/tokens_per_device``, ``train/tokens_per_sec``,
``train/tokens_per_sec_per_device``, ``train/mfu``, ...: Lightning's ``Throughput`` over the last ``window_size``
micro-batches), but that one calls ``torch.cuda.synchronize()`` after every batch to read the
clock. Here each batch end on CUDA is an event; the events become host times at the next logging step, after
one wait for the newest (``t_i = now - elapsed(e_i, e_last)``), so the times are the device's and a step that
does not log never waits. On the CPU the host clock is read directly. Validation time is not training time.

Under tensor and context parallelism the cp x tp ranks of a data-parallel rank share its batches and its FLOPs
(the module counts those of whole sequences): ``Throughput`` counts data-parallel ranks (its global samples/s and
FLOP/s are the job's), and a ``device/`` rate is that of a data-parallel rank, whose MFU is over the peak of its
cp x tp devices.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from pretrain.compat import lightning as lightning_compat
from pretrain.parallel.mesh import data_parallel_position
from pretrain.training.step import ends_step

MFU_CONVENTION = "6N + 12*L*d*T FLOPs per token (torchtitan; no causal halving) / dense peak"
# Lightning's ``Throughput`` names -> names that say what they are (logged under ``train/``): cumulative counts
# since this launch started training, on this device (rank 0); rates over the last ``window_size`` micro-batches,
# on this device or over all ranks; "items" are tokens here (``length_fn``)
NAMES = {
    "time": "seconds",  # training time, validation excluded
    "batches": "micro_batches_per_device",
    "samples": "samples_per_device",
    "lengths": "tokens_per_device",
    "device/batches_per_sec": "micro_batches_per_sec_per_device",
    "device/samples_per_sec": "samples_per_sec_per_device",
    "device/items_per_sec": "tokens_per_sec_per_device",
    "device/flops_per_sec": "flops_per_sec_per_device",
    "device/mfu": "mfu",
    "batches_per_sec": "micro_batches_per_sec",
    "samples_per_sec": "samples_per_sec",
    "items_per_sec": "tokens_per_sec",
    "flops_per_sec": "flops_per_sec",
    "mfu": "mfu",
}

T = 1e12
# lower-cased device-name fragment -> dense peak FLOP/s per dtype. Matched in this order, first hit wins: a
# fragment that is a substring of a later device's name comes after it ("gb200" before "b200", "h100 nvl" and
# "h100 pcie" before "h100", "a100" before "a10g" before "a10", "l40s" before "l40" before "l4").
DENSE_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("gb200", {"fp8": 5000 * T, "bf16": 2500 * T, "tf32": 1250 * T, "fp32": 80 * T}),  # per GPU, NVL72
    ("b200", {"fp8": 4500 * T, "bf16": 2250 * T, "tf32": 1100 * T, "fp32": 75 * T}),  # HGX B200
    ("h200 nvl", {"fp8": 1670.5 * T, "bf16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    ("h200", {"fp8": 1978.9 * T, "bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),  # SXM; GH200
    ("h100 nvl", {"fp8": 1670.5 * T, "bf16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    ("h100 pcie", {"fp8": 1513 * T, "bf16": 756 * T, "tf32": 378 * T, "fp32": 51.2 * T}),
    ("h100", {"fp8": 1978.9 * T, "bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),  # SXM (HBM3)
    ("a100", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),  # 40 GB and 80 GB, SXM and PCIe
    ("a10g", {"bf16": 70 * T, "tf32": 35 * T, "fp32": 31.2 * T}),  # AWS
    ("a10", {"bf16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    ("l40s", {"fp8": 733 * T, "bf16": 362.05 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    ("l40", {"fp8": 362 * T, "bf16": 181 * T, "tf32": 90.5 * T, "fp32": 90.5 * T}),
    ("l4", {"fp8": 242.5 * T, "bf16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    ("a6000", {"bf16": 154.8 * T, "tf32": 77.4 * T, "fp32": 38.7 * T}),
    # RTX 4090: the FP32-accumulate rates (FP16 accumulate doubles them; training accumulates in FP32)
    ("rtx 4090", {"fp8": 330.3 * T, "bf16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T}),
    ("v100", {"fp16": 125 * T, "fp32": 15.7 * T}),
    ("mi300x", {"fp8": 2614.9 * T, "bf16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T}),
]
DTYPES = ("fp8", "bf16", "fp16", "tf32", "fp32")


def dtype_key(dtype: torch.dtype, float8: bool = False) -> str:
    """The peak-table column of a compute dtype: ``fp8`` under float8 training, ``tf32`` for float32 matmuls
    when ``torch.get_float32_matmul_precision()`` allows it."""
    if float8:
        return "fp8"
    if dtype is torch.bfloat16:
        return "bf16"
    if dtype is torch.float16:
        return "fp16"
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def peak_for(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the device called ``device_name`` (as ``torch.cuda.get_device_name`` says) at
    ``dtype`` (one of :data:`DTYPES`); ``None`` when the device or that dtype is not in the table. fp16 and
    bf16 share one tensor-core rate (V100 has fp16 only)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    name = device_name.lower()
    for fragment, table in DENSE_PEAK_FLOPS:
        if fragment in name:
            if dtype in ("bf16", "fp16"):
                return table.get(dtype, table.get("bf16" if dtype == "fp16" else "fp16"))
            return table.get(dtype)
    return None


def compute_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a Lightning precision setting (``bf16-mixed`` -> bfloat16, ``32-true`` -> float32)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for CUDA/ROCm devices, else the device type (``cpu``, ``mps``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def mfu_peak(name: str, dtype: str, override: float | None = None) -> float | None:
    """The peak MFU divides by: ``override`` (``trainer.peak_flops``) if given, else the table's; ``None`` when
    neither knows the device, so no MFU is logged rather than a wrong one (with a warning for a GPU)."""
    if override is not None:
        return override
    peak = peak_for(name, dtype)
    if peak is None and name not in ("cpu", "mps"):  # CPUs have no entry by design (README): no noise there
        warnings.warn(
            f"no dense {dtype} peak FLOP/s known for device {name!r}: MFU is not logged; set "
            "trainer.peak_flops=<FLOP/s per device> to log it",
            stacklevel=2,
        )
    return peak


class PeakThroughputMonitor(Callback):
    """Training throughput and MFU (module docstring) from ``batch_size_fn(batch)`` samples, ``length_fn(batch)``
    tokens and the module's ``flops_per_batch`` per micro-batch; the peak from :data:`DENSE_PEAK_FLOPS` (the fp8
    column with ``float8``) unless ``peak`` (FLOP/s per device) is given. Rank 0 measures and logs, as Lightning's monitor does."""

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int],
        window_size: int,
        peak: float | None = None,
        float8: bool = False,
    ) -> None:
        self.batch_size_fn, self.length_fn, self.peak = batch_size_fn, length_fn, peak
        self.window_size, self.float8 = window_size, float8
        self.throughput: Throughput | None = None
        self._pending: deque[tuple[Any, int, int, int, float]] = deque(maxlen=window_size)
        self._t0 = self._validation_start = 0.0
        self._totals = [0, 0, 0]  # batches, samples, tokens since train start

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        name = device_name(trainer.strategy.root_device)
        dtype = dtype_key(compute_dtype(str(trainer.precision)), self.float8)
        available = mfu_peak(name, dtype, self.peak)  # setup runs once per fit: one warning if unknown
        if available is not None:
            rank_zero_info(f"train/mfu: {MFU_CONVENTION} {available:.4g} FLOP/s ({name}, {dtype})")
        data_parallel = data_parallel_position(trainer)[1]
        sharing = trainer.world_size // data_parallel  # devices that share a batch (cp x tp)
        self.throughput = Throughput(
            available_flops=None if available is None else available * sharing,
            world_size=data_parallel,
            window_size=self.window_size,
        )

    @rank_zero_only
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.throughput is not None
        self.throughput.reset()
        self._pending.clear()
        self._totals = [0, 0, 0]
        self._t0 = time.perf_counter()

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.strategy.root_device.type == "cuda":
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        totals = self._totals
        totals[0] += 1
        totals[1] += self.batch_size_fn(batch)
        totals[2] += self.length_fn(batch)
        flops = pl_module.flops_per_batch  # None where the module counts none (some baselines): no MFU logged
        self._pending.append((mark, *totals, None if flops is None else float(flops)))
        if ends_step(batch_idx, trainer.accumulate_grad_batches) and lightning_compat.should_update_logs(
            trainer
        ):
            self._flush()
            assert self.throughput is not None
            metrics = {f"train/{NAMES.get(k, k)}": v for k, v in self.throughput.compute().items()}
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
            cuda = isinstance(mark, torch.cuda.Event)
            at = now - mark.elapsed_time(last) / 1e3 if cuda else mark - self._t0
            self.throughput.update(
                time=at,
                batches=batches,
                samples=samples,
                lengths=tokens,
                flops=flops,  # type: ignore[arg-type]  # Lightning annotates an int; it divides a float alike
            )
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
