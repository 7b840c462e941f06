"""The Lightning ``CheckpointIO`` plugin of every strategy: atomic checkpoint files, space freed and a clear error
when a write fails, and sharded directories read whole where one process restores them."""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from pretrain.checkpoint.convert import full_checkpoint
from pretrain.checkpoint.io import CheckpointWriteError, read, remove_partial_saves, write_atomically
from pretrain.io import STORAGE_ERRNOS


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
            return full_checkpoint(path)
        return read(path, map_location=map_location)
