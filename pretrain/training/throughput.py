"""Tokens/s and model FLOP utilisation: Lightning's ThroughputMonitor fed with a *dense* peak table.

MFU = (achieved model FLOP/s per device) / (dense peak FLOP/s of the device at the compute dtype), with the model
FLOPs from the backbone's analytic ``flops_per_token`` (6N + attention, forward + backward; PaLM appendix B).
Lightning's own table mixes dense and 2:4-sparse figures (e.g. H200, H100 NVL), which halves MFU on those chips;
this table lists dense tensor-core numbers from the NVIDIA datasheets. CPUs have no entry: MFU is omitted there
unless ``trainer.peak_flops`` gives one.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from pretrain.training.lightning_compat import set_available_flops

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


class PeakThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` whose MFU uses :data:`DENSE_PEAK_FLOPS` (or an explicit per-device peak)."""

    def __init__(self, *args: Any, peak: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peak = peak

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        dtype = compute_dtype(str(trainer.precision))
        set_available_flops(self, self.peak or peak_flops(trainer.strategy.root_device, dtype))
