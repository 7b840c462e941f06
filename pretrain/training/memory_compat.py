"""Every use of torch's private memory-estimation internals, in one place (tested with torch 2.13.0).

- ``fake_mode``: ``torch._subclasses.FakeTensorMode``: tensors with shapes, dtypes and devices but no storage.
- ``trace_peak``: ``torch.distributed._tools.mem_tracker.MemTracker``'s peak snapshot, by category, of what runs
  inside it (parameters, buffers, gradients, optimizer states, activations, backward temporaries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

TESTED_WITH = {"torch": "2.13.0"}


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def trace_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None], repeats: int = 2
) -> dict[str, int]:
    """Bytes at the peak of ``repeats`` calls of ``step()`` (the second training step holds the optimizer
    state): ``params`` (and buffers), ``grads``, ``optimizer``, ``activations`` (activations, temporaries and
    anything else) and ``total``, on the model's device."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(repeats):
            step()
            tracker.reset_mod_stats()  # per-module statistics are for one iteration; the peak is kept
    device = next(model.parameters()).device
    snap = tracker.get_tracker_snapshot("peak")[device]
    parts = {
        "params": snap.get("Parameter", 0) + snap.get("Buffer", 0),
        "grads": snap.get("Gradient", 0),
        "optimizer": snap.get("Optstate", 0),
    }
    total = snap["Total"]
    return {**parts, "activations": total - sum(parts.values()), "total": total}
