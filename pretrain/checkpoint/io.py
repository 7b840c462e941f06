"""Checkpoint files on disk: atomic writes (a reader sees the old checkpoint or the complete new one), the
weights-only read, the atomic directory swap for sharded checkpoints, and which layout a path holds."""

from __future__ import annotations

import os
import pickle
import secrets
import struct
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from pretrain.errors import InputError
from pretrain.io import replace_path

PAYLOAD = "pretrain"  # key of our own section in a Lightning checkpoint
# A sharded checkpoint is a directory holding METADATA (the Lightning checkpoint without weights and optimizer
# state, ``torch.load(weights_only=True)``-able) and either torch.distributed.checkpoint shards (FSDP: DCP's
# ``.metadata`` + ``__<rank>_0.distcp``) or DeepSpeed's layout (``latest`` naming the tag directory).
METADATA = "meta.pt"
DCP_METADATA = ".metadata"
DEEPSPEED_LATEST = "latest"
EMA_KEY = "ema"  # checkpoint["ema"]: parameter name -> the weights' moving average (pretrain.training.callbacks.ema)
DEEPSPEED_STATE_KEYS = frozenset(  # what DeepSpeed adds to the client state in its model-states file
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
    }
)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, no permission); earlier checkpoints are untouched."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(f)`` into a temporary sibling of ``path`` (``.<name>.<random>.tmp``), synced, then renamed over
    ``path`` and the directory synced: a reader sees the old file or the complete new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # created as open() creates files, with the permissions the user's umask gives (mkstemp's are 0600)
    tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp"))
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():  # a sharded checkpoint under the name (FSDP's last.ckpt, continued by one process)
            replace_path(Path(tmp), path)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# what the weights-only unpickler raises on a file that is no pickle at all (a text file: IndexError, KeyError)
GARBAGE = (IndexError, KeyError, TypeError, AttributeError, UnicodeDecodeError, struct.error)


def read(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a single-file checkpoint, with a clear error when it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    try:
        loaded = torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=mmap)
    except (
        RuntimeError,
        EOFError,
        OSError,
        zipfile.BadZipFile,
        ValueError,
        pickle.UnpicklingError,
        *GARBAGE,
    ) as err:
        # torch's own message goes on to advise weights_only=False, which would run the file's code: not shown
        if "unsupported global" in str(err).lower():
            raise InputError(
                f"checkpoint {path} holds objects other than tensors and plain containers, which a weights-only "
                f"load refuses; it was not written by `pretrain fit` (or was altered) and is not loaded"
            ) from err
        raise InputError(f"checkpoint {path} is unreadable (truncated, corrupt or not a checkpoint)") from err
    if not isinstance(loaded, dict):
        raise InputError(f"{path} holds a {type(loaded).__name__}, not a checkpoint (which is a mapping)")
    return loaded


@contextmanager
def atomic_directory(path: str | Path, strategy: Any) -> Iterator[Path]:
    """A temporary sibling directory for every rank of ``strategy`` to write a sharded checkpoint into; once all
    ranks are done, rank 0 puts it in place of ``path`` with :func:`replace_path`."""
    path = Path(strategy.broadcast(str(path)))
    tmp = path.with_name(f".{path.name}.{strategy.broadcast(secrets.token_hex(4))}.tmp")
    yield tmp
    strategy.barrier()
    if strategy.is_global_zero:
        replace_path(tmp, path)
    strategy.barrier()


def remove_partial_saves(checkpoint_dir: str | Path) -> list[Path]:
    """Delete the temporary files and directories (``.<name>.<random>.tmp``) that writes killed mid-save left
    behind; the deleted paths. Only rank 0 puts checkpoints in place, and no write is in flight while this
    runs (at the start of a fit, or on a full disk before a synchronous write), so none of them is in use."""
    import shutil

    directory = Path(checkpoint_dir)
    stale = sorted(directory.glob(".*.tmp")) if directory.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return stale


def kind(path: str | Path) -> str:
    """``"file"``, ``"dcp"`` (a torch.distributed.checkpoint directory: FSDP's, or any written by
    ``checkpoint.async_save``) or ``"deepspeed"`` (a ZeRO directory); ``ValueError`` otherwise."""
    path = Path(path)
    if path.is_file():
        return "file"
    if (path / DCP_METADATA).is_file():
        return "dcp"
    if (path / DEEPSPEED_LATEST).is_file():
        return "deepspeed"
    if path.is_dir():
        inside = sorted(path.glob("*.ckpt")) or sorted(path.glob("checkpoints/*.ckpt"))
        example = f" (e.g. {next((p for p in inside if p.name == 'last.ckpt'), inside[0])})" if inside else ""
        raise InputError(
            f"{path} is a directory, not a checkpoint: pass a checkpoint file{example} or a sharded FSDP/DeepSpeed "
            f"checkpoint directory"
        )
    raise InputError(f"{path} is neither a checkpoint file nor a sharded FSDP/DeepSpeed checkpoint directory")


def lightning_state(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint at ``path`` without its weights and optimizer state: a file (memory-mapped), a
    DCP directory's ``meta.pt``, a DeepSpeed directory's ``meta.pt`` or the client state in its model states."""
    path = Path(path)
    if path.is_dir() and not (path / METADATA).is_file() and kind(path) == "deepspeed":
        return deepspeed_model_states(path, mmap=True)
    return read(path / METADATA if path.is_dir() else path, mmap=True)


def deepspeed_tag(path: Path) -> Path:
    """The tag directory ``latest`` names in a DeepSpeed checkpoint directory."""
    return path / (path / DEEPSPEED_LATEST).read_text().strip()


def deepspeed_model_states(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """DeepSpeed's model-states file of a checkpoint (rank 0's under ZeRO-3), weights-only."""
    files = sorted(deepspeed_tag(path).glob("*model_states.pt"))
    if not files:
        raise InputError(f"{path} is not a complete DeepSpeed checkpoint (no *model_states.pt)")
    return read(files[0], mmap=mmap)


def client_state(states: dict[str, Any]) -> dict[str, Any]:
    """The Lightning state Lightning's DeepSpeed strategy stored in DeepSpeed's model-states file."""
    return {k: v for k, v in states.items() if k not in DEEPSPEED_STATE_KEYS}


def data_position(path: str | Path) -> tuple[int, int]:
    """``(epoch, samples consumed in it)`` of the training stream a checkpoint stopped at ((0, 0) if it holds no
    data state: a datamodule saves ``epoch`` and ``consumed_samples``)."""
    for value in lightning_state(path).values():
        if isinstance(value, dict) and "consumed_samples" in value and "epoch" in value:
            return int(value["epoch"]), int(value["consumed_samples"])
    return 0, 0


def payload(path: str | Path) -> dict[str, Any]:
    """Our section (config, tokenizer, W&B id, tokens seen) of a checkpoint file or sharded directory."""
    path = Path(path)
    meta = path / METADATA if path.is_dir() and kind(path) else path
    ckpt = read(meta, mmap=True)
    if PAYLOAD not in ckpt:
        raise InputError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    return ckpt[PAYLOAD]
