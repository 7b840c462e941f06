"""Checkpoint files on disk: atomic writes (a reader sees the old checkpoint or the complete new one), the
weights-only read, the atomic directory swap for sharded checkpoints, and which layout a path holds."""

from __future__ import annotations

import errno
import os
import pickle
import secrets
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from pretrain.datamodules.storage import STORAGE_ERRNOS, replace_path

PAYLOAD = "pretrain"  # key of our own section in a Lightning checkpoint
# A sharded checkpoint is a directory holding METADATA (the Lightning checkpoint without weights and optimizer
# state, ``torch.load(weights_only=True)``-able) and either torch.distributed.checkpoint shards (FSDP: DCP's
# ``.metadata`` + ``__<rank>_0.distcp``) or DeepSpeed's layout (``latest`` naming the tag directory).
METADATA = "meta.pt"
DCP_METADATA = ".metadata"
DEEPSPEED_LATEST = "latest"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, no permission); earlier checkpoints are untouched."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to a temporary file in the same directory, fsyncs, then ``os.replace``: a reader sees the old file or
    the complete new one, never a partial write (a crash mid-save leaves only a stray ``.tmp``).

    A write that fails for lack of space deletes stale temporary files of killed writes and the files
    ``reclaimable()`` names (checkpoints the retention policy no longer keeps, see ``trainer.outside_retention``)
    and retries once; if it still fails (or for permissions) it raises ``CheckpointWriteError`` naming the
    checkpoints still intact."""

    def __init__(self, reclaimable: Callable[[], list[Path]] | None = None):
        super().__init__()
        self.reclaimable = reclaimable

    def _free_space(self, directory: Path) -> bool:
        """Delete what no policy keeps; whether anything was deleted."""
        freed = bool(remove_partial_saves(directory))
        for path in self.reclaimable() if self.reclaimable else []:
            if path.is_file():
                warnings.warn(
                    f"disk full: deleting {path}, which the retention policy no longer keeps", stacklevel=2
                )
                path.unlink()
                freed = True
        return freed

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        try:
            self._write(checkpoint, path)
        except OSError as err:
            if err.errno not in STORAGE_ERRNOS:
                raise
            if err.errno in (errno.ENOSPC, errno.EDQUOT) and self._free_space(path.parent):
                try:
                    self._write(checkpoint, path)
                    return
                except OSError as again:
                    err = again
            intact = sorted(p.name for p in path.parent.glob("*.ckpt")) if path.parent.is_dir() else []
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {os.strerror(err.errno or 0)}; nothing was overwritten "
                f"(checkpoints intact in {path.parent}: {', '.join(intact) or 'none'}). Free space or fix the "
                f"permissions, lower checkpoint.save_top_k, then rerun the same command (resume=auto continues)",
                err.errno,
            ) from err

    @staticmethod
    def _write(checkpoint: dict[str, Any], path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict:
        return read(path, map_location=map_location)


def read(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a single-file checkpoint, with a clear error when it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, pickle.UnpicklingError) as err:
        # torch's own message goes on to advise weights_only=False, which would run the file's code: not shown
        if "unsupported global" in str(err).lower():
            raise ValueError(
                f"checkpoint {path} holds objects other than tensors and plain containers, which a weights-only "
                f"load refuses; it was not written by `pretrain fit` (or was altered) and is not loaded"
            ) from err
        raise ValueError(f"checkpoint {path} is unreadable (truncated, corrupt or not a checkpoint)") from err


@contextmanager
def atomic_directory(path: str | Path, strategy: Any) -> Iterator[Path]:
    """A temporary sibling directory for every rank of ``strategy`` to write a sharded checkpoint into; once all
    ranks are done, rank 0 puts it in place of ``path`` with :func:`replace_path`."""
    path = Path(strategy.broadcast(str(path)))
    tmp = path.with_name(f".{path.name}.tmp-{strategy.broadcast(secrets.token_hex(4))}")
    yield tmp
    strategy.barrier()
    if strategy.is_global_zero:
        replace_path(tmp, path)
    strategy.barrier()


def remove_partial_saves(checkpoint_dir: str | Path) -> list[Path]:
    """Delete the temporary files (``.<name>.<random>.tmp``) that writes killed mid-save left behind; the
    deleted paths. Only one process (rank 0) writes checkpoint files, and not while this runs, so none of
    them is in use."""
    directory = Path(checkpoint_dir)
    stale = sorted(p for p in directory.glob(".*.tmp") if p.is_file()) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def kind(path: str | Path) -> str:
    """``"file"``, ``"fsdp"`` (DCP shards) or ``"deepspeed"`` (a ZeRO directory); ``ValueError`` otherwise."""
    path = Path(path)
    if path.is_file():
        return "file"
    if (path / DCP_METADATA).is_file():
        return "fsdp"
    if (path / DEEPSPEED_LATEST).is_file():
        return "deepspeed"
    if path.is_dir():
        inside = sorted(path.glob("*.ckpt")) or sorted(path.glob("checkpoints/*.ckpt"))
        example = f" (e.g. {next((p for p in inside if p.name == 'last.ckpt'), inside[0])})" if inside else ""
        raise ValueError(
            f"{path} is a directory, not a checkpoint: pass a checkpoint file{example} or a sharded FSDP/DeepSpeed "
            f"checkpoint directory"
        )
    raise ValueError(f"{path} is neither a checkpoint file nor a sharded FSDP/DeepSpeed checkpoint directory")


def payload(path: str | Path) -> dict[str, Any]:
    """Our section (config, tokenizer, W&B id, tokens seen) of a checkpoint file or sharded directory."""
    path = Path(path)
    meta = path / METADATA if path.is_dir() and kind(path) else path
    ckpt = read(meta, mmap=True)
    if PAYLOAD not in ckpt:
        raise ValueError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    return ckpt[PAYLOAD]
