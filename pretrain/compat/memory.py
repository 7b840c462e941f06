"""Every use of torch's private memory-estimation internals, in one place (tested with torch 2.13.0).

- ``fake_mode``: ``torch._subclasses.FakeTensorMode``: tensors with shapes, dtypes and devices but no storage.
- ``fake_process_group``: torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``): a process
  group of N ranks inside this one process whose collectives communicate nothing (outputs of the right shapes).
- ``meshes_outside_fake_mode``: ``DeviceMesh`` built with the fake mode suspended: FSDP2 over tensor-parallel
  (DTensor) parameters concatenates the data-parallel and tensor-parallel meshes when it shards them
  (``DeviceMesh._concatenate``), and a mesh reads its real rank tensor.
- ``trace_peak``: ``torch.distributed._tools.mem_tracker.MemTracker``'s peak snapshot, by category, of what runs
  inside it (parameters, buffers, gradients, optimizer states, activations, backward temporaries). Under a fake
  mode, DTensor's sharding propagation (``torch.distributed.tensor._sharding_prop``) computes output metadata on
  fake tensors of the *global* shapes in the active fake mode, which the tracker cannot tell from the step's own
  tensors (the fused AdamW step on FSDP2's sharded parameters counted the unsharded parameters, gradients and
  moments once more: 22.6 MB for the tiny GPT on 2 ranks instead of the 14.2 MB real gloo ranks allocate); here
  propagation gets a fake mode of its own, which the tracker skips.
- ``held_state``: the same tracker's current snapshot of a model's parameters, gradients and optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[Any]:
    """A ``world``-rank process group in this process that moves no data, seen from rank 0, and its 1-D CPU
    device mesh (made outside any fake mode: the mesh reads real rank tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError(
            "pretrain plan traces sharded steps in a process group of its own; run it outside a distributed job"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    # its own store: no rendezvous (under torchrun or a test's launcher MASTER_ADDR / MASTER_PORT are set, and each
    # rank would rendezvous there as rank 0 of its fake group)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def meshes_outside_fake_mode() -> Iterator[None]:
    """Every ``DeviceMesh`` made inside (FSDP2's concatenation of the dp and tp meshes) made outside any fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    with mock.patch.object(DeviceMesh, "__init__", real_init):
        yield


def trace_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], None],
    repeats: int = 2,
    setup: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Bytes at the peak of ``repeats`` calls of ``step()`` (the second training step holds the optimizer
    state): ``params`` (and buffers), ``grads``, ``optimizer``, ``activations`` (activations, temporaries and
    anything else) and ``total``, on the model's device. ``setup()`` (wrapping the model in a strategy) runs
    first inside the tracker, so what it allocates is counted, but its own transient peak is not (as
    ``torch.cuda.reset_peak_memory_stats`` at the start of training: the tracker's peak is reset to what is
    live, its private ``_peak_mem`` / ``_peak_mem_snap``, as its ``__enter__`` sets them)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import _sharding_prop

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker, mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None):
        if setup is not None:
            setup()
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()
            tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}
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


def held_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes ``MemTracker`` attributes now to ``model``'s parameters (and buffers), their gradients and
    ``optimizer``'s state (a rank's shards where they are DTensors): ``params``, ``grads``, ``optimizer``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        snap = tracker.get_tracker_snapshot()[next(model.parameters()).device]
    return {
        "params": snap.get("Parameter", 0) + snap.get("Buffer", 0),
        "grads": snap.get("Gradient", 0),
        "optimizer": snap.get("Optstate", 0),
    }
