"""Checkpoint conversion tensor by tensor (``pretrain convert``, ``consolidate``, DeepSpeed -> DCP for a resume):
the source's structure is built with placeholder tensors that hold no memory
(``torch_save_compat.placeholders``), and each tensor is read from the source only when the writer reaches it,
then dropped: a conversion holds one tensor (plus the reader's buffers) at a time, whatever the checkpoint's size.

Sources: a DCP directory (each tensor read whole from its shards by ``torch.distributed.checkpoint``), a DeepSpeed
directory (DeepSpeed's ``ds_to_universal`` first writes each parameter's fp32 weights, moments and step whole,
one file each), a file (memory-mapped: each tensor copied out of the mapping when the writer reaches it, the
mapping's pages released as they are copied). Targets: one file (``torch.save``'s bytes: ``torch_save_compat.save_filled``), a DCP directory
(``torch.distributed.checkpoint.save`` with a planner that reads each tensor as it writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import io
import mmap
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pretrain.checkpoint import dcp
from pretrain.checkpoint.io import (
    EMA_KEY,
    METADATA,
    PAYLOAD,
    client_state,
    deepspeed_model_states,
    deepspeed_tag,
    kind,
    read,
    write_atomically,
)
from pretrain.checkpoint.optimizer_state import (
    is_name_keyed,
    optimizer_count,
    optimizer_state_by_names,
    optimizer_state_by_position,
)
from pretrain.compat.torch_save import placeholders, read_chunks_into, save_filled
from pretrain.errors import InputError
from pretrain.io import replace_path
from pretrain.memory import unpooled

Placeholder = Callable[[torch.Size, torch.dtype], torch.Tensor]


@dataclass
class Source:
    """A checkpoint as placeholders: ``meta`` (the Lightning state without weights), ``tensors`` (the DCP layout:
    ``state_dict`` and ``optimizer_0`` keyed by parameter name, every tensor a placeholder) and ``load`` (the real
    tensor of a placeholder, read when asked)."""

    meta: dict[str, Any]
    tensors: dict[str, Any]
    load: Callable[[str], torch.Tensor]
    loadable: set[str]  # the DCP keys of the placeholders (other tensors are real: small ones)
    keys: dict[int, str] = field(default_factory=dict)  # placeholder storage address -> DCP key

    def register(self) -> None:
        for key, path in dcp.flatten(self.tensors).items():
            value = dcp.get_path(self.tensors, path)
            if key in self.loadable and value.numel():
                self.keys[value.untyped_storage().data_ptr()] = key

    def fill(self, storage: torch.UntypedStorage) -> torch.Tensor | None:
        key = self.keys.get(storage.data_ptr())
        return None if key is None else self.load(key).contiguous()


@contextlib.contextmanager
def open_source(path: str | Path, work_dir: str | Path | None = None) -> Iterator[Source]:
    """The checkpoint at ``path`` (a DCP or DeepSpeed directory) as a :class:`Source`, valid inside the context;
    a DeepSpeed checkpoint's universal conversion goes to a temporary directory in ``work_dir``."""
    path = Path(path)
    found = kind(path)
    with placeholders() as make:
        if found == "dcp":
            source = _dcp_source(path, make)
        elif found == "deepspeed":
            with tempfile.TemporaryDirectory(dir=work_dir, prefix=f".{path.name}.universal.") as tmp:
                source = _deepspeed_source(path, Path(tmp), make)
                source.register()
                yield source
                return
        else:
            source = _file_source(path)
        source.register()
        yield source


def _file_source(path: Path) -> Source:
    """A checkpoint file, memory-mapped, as the DCP layout: its numbered optimizer state keyed by the parameter
    names of the optimizer's groups (``group_param_names`` of the model and optimizer it was trained with)."""
    from pretrain.models.config import ModelConfig
    from pretrain.optim import group_param_names

    meta = read(path, mmap=True)
    tensors: dict[str, Any] = {"state_dict": meta.pop("state_dict")}
    for i, state in enumerate(meta.pop("optimizer_states", [])):
        if not is_name_keyed(state):
            config = meta.get(PAYLOAD, {}).get("config")
            if config is None:
                raise InputError(
                    f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)"
                )
            optim = config["optim"]
            names = group_param_names(
                ModelConfig(**config["model"]), optim["weight_decay"], muon=optim["name"] == "muon"
            )
            state = optimizer_state_by_names(state, names)
        tensors[f"optimizer_{i}"] = state
    if EMA_KEY in meta:
        tensors[EMA_KEY] = meta.pop(EMA_KEY)
    paths = dcp.flatten(tensors)
    mapped = {k: v for k, p in paths.items() if isinstance(v := dcp.get_path(tensors, p), torch.Tensor)}
    return Source(
        meta, tensors, lambda key: released_copy(mapped[key]), {k for k, v in mapped.items() if v.numel()}
    )


_CHUNK = 16 << 20  # bytes copied out of a mapping before its pages are released


def _release(address: int, nbytes: int) -> None:
    """``madvise(MADV_DONTNEED)`` over the pages of ``[address, address + nbytes)``: a private file mapping's clean
    pages leave the resident set (read again from the file if touched again)."""
    start = address - address % mmap.PAGESIZE
    end = -(-(address + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill the memory from its first to its last without gap or overlap."""
    expected = 1
    for size, stride in sorted(
        (p for p in zip(tensor.shape, tensor.stride()) if p[0] != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def released_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A memory-mapped file's ``tensor`` copied into memory of its own (:func:`unpooled`) 16 MiB at a time, each
    chunk's file pages released once copied: the pages a writer reads from the mapping stayed resident until the
    whole file was (a file converted ``--to dcp`` grew the resident size to the file's size). The copy keeps the
    strides of a tensor that covers its memory densely (a transposed one), as DCP writes the tensor itself."""
    if not tensor.numel():
        return unpooled(tensor.shape, tensor.dtype)
    if not _dense(tensor):  # a view with gaps: copied whole, contiguous (DCP clones it)
        out = unpooled(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        _release(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return out
    flat = unpooled(torch.Size([tensor.numel()]), tensor.dtype)
    target = flat.view(torch.uint8)
    source = torch.as_strided(tensor, (tensor.numel(),), (1,)).view(torch.uint8)  # its memory, in order
    for at in range(0, source.numel(), _CHUNK):
        target[at : at + _CHUNK].copy_(source[at : at + _CHUNK])
        _release(source.data_ptr() + at, min(_CHUNK, source.numel() - at))
    return flat.as_strided(tensor.shape, tensor.stride())


def _dcp_source(path: Path, make: Placeholder) -> Source:
    md = dcp.metadata(path)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    objects = dcp.read_flat(path, [k for k in md.state_dict_metadata if k not in tensors], md)
    flat = {
        key: make(tensors[key].size, tensors[key].properties.dtype) if key in tensors else objects[key]
        for key in md.state_dict_metadata
    }

    def load(key: str) -> torch.Tensor:
        item = tensors[key]  # a placeholder's: a tensor
        out = unpooled(item.size, item.properties.dtype)
        return out if read_chunks_into(path, md, key, out) else dcp.read_flat(path, [key], md)[key]

    return Source(read(path / METADATA), dcp.unflatten(flat, md), load, set(tensors))


def _deepspeed_source(path: Path, universal: Path, make: Placeholder) -> Source:
    """DeepSpeed's ``ds_to_universal`` (every parameter's fp32 weights, ``exp_avg``, ``exp_avg_sq``, ``step``
    whole, one file each) read as the DCP layout: names in DeepSpeed's group order, the optimizer's groups from
    its ``optimizer_state.pt``; buffers and tensors the converter leaves out from the model states."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    states = deepspeed_model_states(path)
    meta = read(path / METADATA) if (path / METADATA).is_file() else client_state(states)
    options = argparse.Namespace(
        input_folder=str(deepspeed_tag(path)),
        output_folder=str(universal),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(options)
    zero = universal / "zero"
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum]):
        groups = torch.load(zero / "optimizer_state.pt", weights_only=True)["param_groups"]
    names = [list(shapes) for shapes in states["param_shapes"]]
    shapes = {n: torch.Size(shape) for group in states["param_shapes"] for n, shape in group.items()}
    shared = (
        states.get("shared_params") or {}
    )  # a tied parameter -> the one it is (listed once in the groups)
    files: dict[str, tuple[Path, torch.Size]] = {}

    def placeholder(key: str, file: Path, shape: torch.Size) -> torch.Tensor:
        files[key] = (file, shape)
        return make(shape, torch.float32)  # ds_to_universal writes float32

    weights = {}
    for name, tensor in states["module"].items():  # ZeRO-3: the module's parameters are empty here
        owner = shared.get(name, name)
        if owner in shapes:
            weights[name] = placeholder(f"state_dict.{name}", zero / owner / "fp32.pt", shapes[owner])
        else:
            weights[name] = tensor  # a buffer, whole in the model states
    step = _step(path, zero)
    state: dict[str, dict[str, Any]] = {}
    for name in (n for group in names for n in group):
        entry: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
        for moment in ("exp_avg", "exp_avg_sq"):
            file = zero / name / f"{moment}.pt"
            if file.is_file():
                entry[moment] = placeholder(f"optimizer_0.state.{name}.{moment}", file, shapes[name])
        state[name] = entry
    param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": group_names}
        for g, group_names in zip(groups, names, strict=True)
    ]
    tensors = {"state_dict": weights, "optimizer_0": {"state": state, "param_groups": param_groups}}
    return Source(meta, tensors, lambda key: _universal(*files[key]), set(files))


def _step(path: Path, zero: Path) -> float:
    """The optimizer's step count: ``ds_to_universal``'s ``step.pt`` (ZeRO-1/2); under ZeRO-3, which it does not
    write, the base optimizer state of rank 0's optimizer file (memory-mapped: its tensors are not read)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    written = sorted(zero.glob("*/step.pt"))
    if written:
        return float(torch.load(written[0], weights_only=True))
    files = sorted(deepspeed_tag(path).glob("*rank_0*optim_states.pt"))
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        optim = torch.load(files[0], weights_only=True, mmap=True)["optimizer_state_dict"]
    base = optim["optimizer_state_dict"]["state"]
    return float(next(s["step"] for s in base.values() if "step" in s))


def _universal(file: Path, shape: torch.Size) -> torch.Tensor:
    """A tensor ``ds_to_universal`` wrote: ``{"param": tensor}`` (ZeRO-1/2) or a flat tensor (ZeRO-3), memory-mapped
    (its pages read as they are written out, unmapped with the tensor)."""
    value = torch.load(file, weights_only=True, mmap=True)
    return (value["param"] if isinstance(value, dict) else value).reshape(shape)


class _ReadingPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` over placeholders: each tensor item is read from the source when it is written.
    ``FileSystemWriter`` keeps a reference to every tensor it wrote until its file is closed (a dict it uses only
    for its safetensors format): the whole checkpoint stayed resident. The planner is asked for the next tensor
    once the one before is written, so it then releases that one's pages (``MADV_DONTNEED``: anonymous ones freed,
    a mapped file's dropped); the dict's reference, never read in the torch-save format, sees zeros."""

    def __init__(self, source: Source):
        super().__init__()
        self.source = source
        self.written: torch.Tensor | None = None

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn not in self.source.loadable:
            return super().resolve_data(write_item)
        if self.written is not None:  # written by now: its memory given back
            storage = self.written.untyped_storage()
            _release(storage.data_ptr(), storage.nbytes())
        self.written = self.source.load(write_item.index.fqn)
        return self.written


def write_dcp(source: Source, out: str | Path) -> Path:
    """``source`` as a DCP directory ``out`` (the layout of FSDP's sharded checkpoints, ``meta.pt`` included),
    written to a temporary sibling and put in place once complete."""
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint import FileSystemWriter

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        written = Path(tmp) / "dcp"
        writer = FileSystemWriter(written, thread_count=1, sync_files=True)
        torch_dcp.save(source.tensors, storage_writer=writer, planner=_ReadingPlanner(source), no_dist=True)
        torch.save(source.meta, written / METADATA)
        replace_path(written, out)
    return out


def write_single(source: Source, out: str | Path) -> Path:
    """``source`` as one checkpoint file ``out`` in the layout of a single-process run's (optimizer state by
    position): the bytes ``torch.save`` writes for it, written atomically."""
    out = Path(out)
    checkpoint = dict(source.meta)
    checkpoint["state_dict"] = source.tensors["state_dict"]
    checkpoint["optimizer_states"] = [
        optimizer_state_by_position(source.tensors[f"optimizer_{i}"])
        for i in range(optimizer_count(source.tensors))
    ]
    if EMA_KEY in source.tensors:
        checkpoint[EMA_KEY] = source.tensors[EMA_KEY]
    write_atomically(out, lambda f: save_filled(checkpoint, f, source.fill))
    return out


TARGETS = ("single", "dcp", "hf")


def convert(path: str | Path, to: str, out: str | Path) -> Path:
    """Checkpoint ``path`` (a file, a DCP directory, a DeepSpeed directory) written as ``to``: ``single`` (one file
    in the layout of a single-process run's, what ``consolidate`` writes) or ``dcp`` (a DCP directory in the layout
    of FSDP's sharded checkpoints), tensor by tensor. ``out`` must not exist."""
    path, out = Path(path), Path(out)
    if to not in ("single", "dcp"):
        raise InputError(f"--to {to}: convert writes one of {', '.join(TARGETS)}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} not found")
    if out.exists():
        raise InputError(f"{out} exists; convert into a new path (nothing is overwritten)")
    found = kind(path)
    if (found, to) in (("file", "single"), ("dcp", "dcp")):
        raise InputError(
            f"{path} is a {to} checkpoint already; convert it --to {'dcp' if to == 'single' else 'single'}"
        )
    with open_source(path, work_dir=out.parent) as source:
        return write_single(source, out) if to == "single" else write_dcp(source, out)
