"""Self-contained, atomically written checkpoints; `resume=auto`; loading for inference; sharded consolidation.

A checkpoint is Lightning's (weights, optimizer, scheduler, loop progress, callbacks, datamodule position) plus
``checkpoint["pretrain"]``: the resolved run config, the tokenizer (``tokenizer.json`` text), the W&B run id and
the tokens seen. Dropout randomness is a function of (seed, optimizer step, micro-batch, rank) -- see
``PretrainModule`` -- so restoring the step restores the random state exactly. Files are loaded with
``torch.load(weights_only=True)``: no code from a checkpoint ever runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pickle
import secrets
import shutil
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from tokenizers import Tokenizer

from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

PAYLOAD = "pretrain"  # key of our own section in a Lightning checkpoint
# A sharded checkpoint is a directory holding METADATA (the Lightning checkpoint without weights and optimizer
# state, ``torch.load(weights_only=True)``-able) and either torch.distributed.checkpoint shards (FSDP: DCP's
# ``.metadata`` + ``__<rank>_0.distcp``) or DeepSpeed's layout (``latest`` naming the tag directory).
METADATA = "meta.pt"
DCP_METADATA = ".metadata"
DEEPSPEED_LATEST = "latest"


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


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


def _rename_exchange(src: Path, dst: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_exchange) == 0


def replace_path(src: Path, dst: Path) -> None:
    """Move the complete ``src`` (file or directory) to ``dst``, replacing whatever is there in one atomic step
    (an exchange of the two names, then the old one is deleted); a reader never sees a partial checkpoint."""
    if dst.exists() and _rename_exchange(src, dst):
        old = src
    elif dst.exists():  # no atomic exchange on this platform: two renames, the old copy kept until the second
        old = dst.with_name(f".{dst.name}.old-{secrets.token_hex(4)}")
        os.replace(dst, old)
        os.replace(src, dst)
    else:
        os.replace(src, dst)
        return
    shutil.rmtree(old) if old.is_dir() else old.unlink()


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


def kind(path: str | Path) -> str:
    """``"file"``, ``"fsdp"`` (DCP shards) or ``"deepspeed"`` (a ZeRO directory); ``ValueError`` otherwise."""
    path = Path(path)
    if path.is_file():
        return "file"
    if (path / DCP_METADATA).is_file():
        return "fsdp"
    if (path / DEEPSPEED_LATEST).is_file():
        return "deepspeed"
    raise ValueError(f"{path} is neither a checkpoint file nor a sharded FSDP/DeepSpeed checkpoint directory")


def is_valid(path: Path) -> bool:
    """A complete checkpoint: a file whose zip archive passes its CRC checks and that unpickles safely, or a
    sharded directory (FSDP or DeepSpeed) with its metadata (directories are put in place only once complete)."""
    if path.is_dir():
        try:
            found = kind(path)
        except ValueError:
            return False
        if found == "deepspeed" and not (path / METADATA).is_file():
            return True  # saved by Lightning's DeepSpeedStrategy itself: DeepSpeed writes `latest` last
        return is_valid(path / METADATA)
    try:
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return False
        read(path, mmap=True)
    except (ValueError, zipfile.BadZipFile, OSError):
        return False
    return True


def checkpoint_step(path: Path) -> int:
    """``global_step`` of a checkpoint file, of an FSDP sharded directory (``meta.pt``) or of a DeepSpeed
    directory (``latest`` names the tag; Lightning's state is in the tag's ``*model_states.pt``).
    ``ValueError`` when it cannot be read."""
    if path.is_dir() and not (path / METADATA).is_file():
        latest = path / "latest"
        tag = latest.read_text().strip() if latest.is_file() else ""
        states = sorted((path / tag).glob("*model_states.pt")) if tag else []
        if not states:
            raise ValueError(
                f"{path} is neither a checkpoint file nor a complete sharded checkpoint directory"
            )
        path = states[0]
    elif path.is_dir():
        path = path / METADATA
    try:
        return int(read(path, mmap=True)["global_step"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"checkpoint {path} records no global_step") from err


def find_resume(checkpoint_dir: str | Path, hpc_dir: str | Path | None = None) -> Path | None:
    """The valid checkpoint of the highest global step among ``checkpoint_dir/*.ckpt`` and Lightning's
    ``hpc_dir/hpc_ckpt_*.ckpt`` (ties: ``last.ckpt``, then the newer write). Modification times would mislead:
    a sharded directory keeps the time of its first save. Unreadable, truncated or corrupt candidates are
    skipped with a warning; ``None`` when there is no candidate (a fresh run)."""
    directory = Path(checkpoint_dir)
    candidates = sorted(directory.glob("[!.]*.ckpt")) if directory.is_dir() else []
    if hpc_dir is not None and Path(hpc_dir).is_dir():
        candidates += sorted(Path(hpc_dir).glob("hpc_ckpt_*.ckpt"))
    ranked = []
    for path in candidates:
        try:
            ranked.append(
                (checkpoint_step(path), path.name == "last.ckpt", path.stat().st_mtime_ns, path.name, path)
            )
        except (ValueError, OSError):
            _skip(path)
    for *_, path in sorted(ranked, reverse=True):
        if is_valid(path):
            return path
        _skip(path)
    if candidates:
        raise ValueError(
            f"resume=auto: no valid checkpoint among {sorted(p.name for p in candidates)} in {directory}"
        )
    return None


def _skip(path: Path) -> None:
    warnings.warn(
        f"resume=auto: skipping checkpoint {path}, which is truncated or corrupt; falling back to an older one",
        stacklevel=3,
    )


def remove_partial_saves(checkpoint_dir: str | Path) -> list[Path]:
    """Delete the temporary files (``.<name>.<random>.tmp``) that writes killed mid-save left behind; the
    deleted paths. Only one process (rank 0) writes checkpoint files, and not while this runs, so none of
    them is in use."""
    directory = Path(checkpoint_dir)
    stale = sorted(p for p in directory.glob(".*.tmp") if p.is_file()) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def payload(path: str | Path) -> dict[str, Any]:
    """Our section (config, tokenizer, W&B id, tokens seen) of a checkpoint file or sharded directory."""
    path = Path(path)
    meta = path / METADATA if path.is_dir() else path
    ckpt = read(meta, mmap=True)
    if PAYLOAD not in ckpt:
        raise ValueError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    return ckpt[PAYLOAD]


def check_compatible(saved_config: dict[str, Any], model_config: dict[str, Any], path: str | Path) -> None:
    """``ValueError`` when a checkpoint's model differs in architecture or any shape from the configured one."""
    diffs = {k: (saved_config.get(k), v) for k, v in model_config.items() if saved_config.get(k) != v}
    if diffs:
        listed = ", ".join(
            f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(diffs.items())
        )
        raise ValueError(
            f"checkpoint {path} holds a different model ({listed}); resume with the recipe it was trained with, "
            "or start a fresh run (resume=null, another run_dir)"
        )


def optimizer_state_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``torch.distributed.checkpoint.state_dict``'s layout: ``state`` by parameter
    name, groups listing names) in ``torch.optim.Optimizer.state_dict``'s layout: parameters numbered in the
    order the groups list them."""
    numbers: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [numbers.setdefault(n, len(numbers)) for n in group["params"]]})
    return {"state": {numbers[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_by_position` for ``optimizer`` over ``model``'s parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    by_number: dict[int, str] = {}
    groups = []
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        by_number.update(zip(saved["params"], (names[id(p)] for p in live["params"]), strict=True))
        groups.append({**saved, "params": [by_number[i] for i in saved["params"]]})
    return {"state": {by_number[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def consolidate(path: str | Path, output: str | Path) -> Path:
    """One-file checkpoint from a sharded one, in the layout of a single-process run's checkpoint (it resumes a
    run under any strategy). FSDP shards are read with ``torch.distributed.checkpoint``; DeepSpeed ZeRO
    directories need ``deepspeed`` (its files are trusted pickles; weights only). A file is returned unchanged."""
    path, output = Path(path), Path(output)
    found = kind(path)
    if found == "file":
        return path
    if found == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            shards = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
        checkpoint = read(path / METADATA)
        checkpoint["state_dict"] = shards["state_dict"]
        checkpoint["optimizer_states"] = [
            optimizer_state_by_position(shards[k]) for k in sorted(shards) if k.startswith("optimizer_")
        ]
        AtomicCheckpointIO().save_checkpoint(checkpoint, output)
        return output
    try:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ValueError("consolidating a DeepSpeed checkpoint needs `pip install deepspeed`") from err
    convert_zero_checkpoint_to_fp32_state_dict(path, output)
    return output


def model_state(checkpoint: dict[str, Any], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The backbone's weights from a Lightning ``state_dict`` (``PretrainModule.model`` -> keys ``model.*``)."""
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def load_model(path: str | Path) -> tuple[Transformer, dict[str, Any], Tokenizer | None]:
    """``(model in eval mode, payload, tokenizer)`` from a checkpoint file or a sharded checkpoint directory."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        single = consolidate(path, Path(tmp) / "consolidated.ckpt") if path.is_dir() else path
        checkpoint = read(single)
    if PAYLOAD not in checkpoint:
        raise ValueError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    info = checkpoint[PAYLOAD]
    model = Transformer(ModelConfig(**info["config"]["model"]))
    model.load_state_dict(model_state(checkpoint))
    tokenizer = Tokenizer.from_str(info["tokenizer_json"]) if info.get("tokenizer_json") else None
    return model.eval(), info, tokenizer
