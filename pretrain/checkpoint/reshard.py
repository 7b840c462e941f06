"""Reload anywhere: a checkpoint written under any strategy and world size, restored under any other.

Which path each (written by, read by) pair takes:

=========================  ===============================  ===============================  ============================
written by                 one device / DDP                 FSDP2                            DeepSpeed ZeRO-1/2/3
=========================  ===============================  ===============================  ============================
one file (DDP, one         as written                       weights and optimizer state      fragment API (below)
device, FSDP ``full``)                                      sharded as they load
DCP directory (FSDP        read whole (DCP)                 DCP resharding to this           fragment API
``sharded``, async save)                                    mesh
DeepSpeed directory        ``ds_to_universal``, then as     ``ds_to_universal``, then as     same world size and stage:
                           a DCP directory                  a DCP directory                  DeepSpeed's own load; else
                                                                                             ``ds_to_universal``, then
                                                                                             fragment API
=========================  ===============================  ===============================  ============================

A DeepSpeed directory read by another layout is converted once by DeepSpeed's own universal-checkpoint converter
(``deepspeed.checkpoint.ds_to_universal``: each parameter's fp32 weights, Adam moments and step, whole) into a
DCP directory in the layout of FSDP's sharded checkpoints (``state_dict``, ``optimizer_0`` keyed by parameter
name, ``meta.pt``), cached under the run directory. Into DeepSpeed, the weights, fp32 master weights and Adam
moments of a foreign checkpoint are set through DeepSpeed's public API for partitioned state
(``deepspeed.utils.safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``; ZeRO-3 weights inside
``deepspeed.zero.GatheredParameters``): ``lightning_compat.DeepSpeedAnyDevice``.

Converting a DeepSpeed checkpoint runs DeepSpeed's converter, which unpickles DeepSpeed's files as DeepSpeed's
own loader does: a DeepSpeed checkpoint is trusted as much as DeepSpeed trusts it. What is read from the
converted files here is read weights-only.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from filelock import FileLock

from pretrain.checkpoint import dcp
from pretrain.checkpoint.io import METADATA, deepspeed_model_states, deepspeed_tag, kind, read
from pretrain.checkpoint.optimizer_state import optimizer_count, optimizer_state_by_names
from pretrain.checkpoint.stream import open_source, write_dcp

CACHE = ".resume"  # under the run directory: DeepSpeed checkpoints converted for this run's strategy


def deepspeed_layout(path: Path) -> tuple[int, int]:
    """``(data-parallel world size, ZeRO stage)`` a DeepSpeed checkpoint was written with."""
    states = deepspeed_model_states(path)
    return int(states["dp_world_size"]), int(states["ds_config"]["zero_optimization"]["stage"])


def loadable(ckpt: Path, strategy: str, world_size: int, stage: int | None, cache_root: Path) -> Path:
    """The checkpoint that ``strategy`` (ZeRO ``stage`` under DeepSpeed) on ``world_size`` ranks restores for
    ``ckpt``: ``ckpt`` itself, or for a DeepSpeed checkpoint of another strategy, world size or stage its DCP
    conversion (made once, under a lock: every rank may ask at the same time)."""
    if kind(ckpt) != "deepspeed":
        return ckpt
    if strategy == "deepspeed" and deepspeed_layout(ckpt) == (world_size, stage):
        return ckpt
    return converted(ckpt, cache_root)


def converted(ckpt: Path, cache_root: Path) -> Path:
    """The DCP conversion of DeepSpeed checkpoint ``ckpt`` under ``cache_root`` (made if missing)."""
    files = sorted(p for p in deepspeed_tag(ckpt).iterdir() if p.is_file())
    stamp = ",".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{ckpt.resolve()}|{stamp}".encode()).hexdigest()[:12]
    out = cache_root / f"{ckpt.name}-{key}"
    cache_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / METADATA).is_file():
            deepspeed_to_dcp(ckpt, out)
    return out


def deepspeed_to_dcp(ckpt: Path, out: Path) -> Path:
    """DeepSpeed checkpoint directory ``ckpt`` -> DCP directory ``out``, tensor by tensor (``stream``): DeepSpeed's
    ``ds_to_universal`` gives each parameter whole (fp32 weights, ``exp_avg``, ``exp_avg_sq``, ``step``); they
    are written with the optimizer's parameter groups (names in DeepSpeed's group order) and the Lightning state
    (``meta.pt``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open_source(ckpt, work_dir=out.parent) as source:
        return write_dcp(source, out)


def named_checkpoint(path: Path, group_names: list[list[str]]) -> dict[str, Any]:
    """A file or DCP checkpoint in memory with its optimizer state keyed by parameter name: the Lightning state
    plus ``state_dict`` (whole tensors) and ``optimizer_<i>``. ``group_names``: the parameter names of each
    optimizer group in order (what a file's numbered state refers to)."""
    found = kind(path)
    if found == "dcp":
        checkpoint = read(path / METADATA)
        checkpoint.update(dcp.read(path))
        return checkpoint
    if found != "file":
        raise ValueError(f"{path}: a {found} checkpoint is converted first (reshard.loadable)")
    checkpoint = read(path)
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        checkpoint[f"optimizer_{i}"] = optimizer_state_by_names(state, group_names)
    assert optimizer_count(checkpoint) <= 1, "one optimizer (the run's)"
    return checkpoint


def remove_cache(run_dir: str | Path) -> None:
    """Delete this run's converted checkpoints (once the fit has loaded them)."""
    shutil.rmtree(Path(run_dir) / CACHE, ignore_errors=True)
