"""Which checkpoint a run resumes from, and whether it may: ``resume=auto`` discovery (highest valid step), the
model-compatibility check, and which strategy restores which checkpoint layout."""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

from pretrain.models.config import ModelConfig
from pretrain.training.checkpoint.io import DEEPSPEED_LATEST, METADATA, kind, read


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
        latest = path / DEEPSPEED_LATEST
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


def check_compatible(saved_config: dict[str, Any], model_config: dict[str, Any], path: str | Path) -> None:
    """``ValueError`` when a checkpoint's weights are not those of the configured model: any field of
    ``ModelConfig.identity`` differs (run-time settings -- attention backend, dropout, init -- may change)."""
    saved, configured = ModelConfig.identity(saved_config), ModelConfig.identity(model_config)
    diffs = {k: (saved[k], v) for k, v in configured.items() if saved[k] != v}
    if diffs:
        listed = ", ".join(
            f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(diffs.items())
        )
        raise ValueError(
            f"checkpoint {path} holds a different model ({listed}); resume with the recipe it was trained with, "
            "or start a fresh run (resume=null, another run_dir)"
        )


def strategy_reads(strategy: str, ckpt: Path) -> bool:
    """Whether the Trainer under ``strategy`` restores checkpoint ``ckpt`` itself (FSDP reads its shards and single
    files, DeepSpeed only its own directories, DDP and single-device only files)."""
    found = kind(ckpt)
    if strategy == "deepspeed":
        return found == "deepspeed"
    return found == "file" or (found == "fsdp" and strategy == "fsdp")


def check_resumable(strategy: str, ckpt: Path) -> None:
    """``ValueError`` naming the strategy to use when the Trainer under ``strategy`` cannot restore ``ckpt``."""
    if strategy_reads(strategy, ckpt):
        return
    found = kind(ckpt)
    if found == "deepspeed":
        raise ValueError(
            f"resume={ckpt} is a DeepSpeed checkpoint directory; resume it with strategy.name=deepspeed"
        )
    if found == "fsdp":
        raise ValueError(
            f"resume={ckpt} is an FSDP checkpoint directory; resume it with strategy.name=fsdp, or under "
            f"{strategy} from a single file made by pretrain.training.checkpoint.consolidate"
        )
    raise ValueError(
        f"resume={ckpt} is a single file, which strategy deepspeed cannot restore; use strategy.name=fsdp or ddp"
    )
