"""Checkpoint files on disk: atomic writes (a reader sees the old checkpoint or the complete new one), the
weights-only read, the atomic directory swap for sharded checkpoints, and which layout a path holds."""

from __future__ import annotations

import errno
import os
import pickle
import secrets
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from pretrain.errors import InputError
from pretrain.io import STORAGE_ERRNOS, replace_path

PAYLOAD = "pretrain"  # key of our own section in a Lightning checkpoint
# A sharded checkpoint is a directory holding METADATA (the Lightning checkpoint without weights and optimizer
# state, ``torch.load(weights_only=True)``-able) and either torch.distributed.checkpoint shards (FSDP: DCP's
# ``.metadata`` + ``__<rank>_0.distcp``) or DeepSpeed's layout (``latest`` naming the tag directory).
METADATA = "meta.pt"
DCP_METADATA = ".metadata"
DEEPSPEED_LATEST = "latest"
EMA_KEY = "ema"  # checkpoint["ema"]: parameter name -> the weights' moving average (pretrain.training.callbacks.ema)


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
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
        write_atomically(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict:
        """A checkpoint file, or a sharded directory read whole (what DDP and one device restore)."""
        if Path(path).is_dir():
            from pretrain.checkpoint.convert import full_checkpoint

            return full_checkpoint(path)
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
            raise InputError(
                f"checkpoint {path} holds objects other than tensors and plain containers, which a weights-only "
                f"load refuses; it was not written by `pretrain fit` (or was altered) and is not loaded"
            ) from err
        raise InputError(f"checkpoint {path} is unreadable (truncated, corrupt or not a checkpoint)") from err


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
        tag = path / (path / DEEPSPEED_LATEST).read_text().strip()
        states = sorted(tag.glob("*model_states.pt"))
        if not states:
            raise InputError(f"{path} is not a complete DeepSpeed checkpoint (no *model_states.pt)")
        return read(states[0], mmap=True)
    return read(path / METADATA if path.is_dir() else path, mmap=True)


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
