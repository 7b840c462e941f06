"""Which checkpoint a run resumes from, and whether it may: ``resume=auto`` discovery (highest valid step), the
model-compatibility check, and which strategy restores which checkpoint layout."""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpoint.io import DEEPSPEED_LATEST, METADATA, PAYLOAD, kind, read
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig


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
            raise InputError(
                f"{path} is neither a checkpoint file nor a complete sharded checkpoint directory"
            )
        path = states[0]
    elif path.is_dir():
        path = path / METADATA
    try:
        return int(read(path, mmap=True)["global_step"])
    except (KeyError, TypeError) as err:
        raise InputError(f"checkpoint {path} records no global_step") from err


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
        if not is_valid(path):
            _skip(path)
        elif weights_only(path):
            warnings.warn(f"resume=auto: skipping {path}: {weights_only(path)}", stacklevel=2)
        else:
            return path
    if candidates:
        raise InputError(
            f"resume=auto: no valid checkpoint among {sorted(p.name for p in candidates)} in {directory}"
        )
    return None


def weights_only(path: Path) -> str | None:
    """What ``path`` is when it holds a model's weights but no training state to resume (a ``pretrain merge``
    output: no optimizer state), else None. Sharded directories always hold the training state."""
    if path.is_dir():
        return None
    state = read(path, mmap=True)
    if "optimizer_states" in state:
        return None
    merged = isinstance(state.get(PAYLOAD), dict) and "merged_from" in state[PAYLOAD]
    return f"weights only{' (a `pretrain merge` output)' if merged else ''}, no optimizer state to resume"


def check_trainable(ckpt: Path) -> None:
    """``InputError`` when training cannot resume from ``ckpt`` (weights only); before anything heavy runs."""
    if what := weights_only(ckpt):
        raise InputError(
            f"resume={ckpt} holds {what}; start a run from its weights with init.checkpoint={ckpt} and "
            "resume=null (or name=NEW)"
        )


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
        raise InputError(
            f"checkpoint {path} holds a different model ({listed}); resume with the recipe it was trained with, "
            "or start a fresh run (resume=null, another run_dir)"
        )


MISSING = object()  # a key an older checkpoint does not record: not compared


def at(tree: Any, dotted: str) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"``; ``MISSING`` when a level is absent."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


@dataclass(frozen=True)
class Compared:
    """One thing a resume compares between the checkpoint and the run: the values ``values(payload)`` gives
    (display name -> value; ``payload`` is the checkpoint's section ``PAYLOAD``, or the one the run would write),
    the ``resume_allow`` entry that lets them differ (None: never), and what allowing it means."""

    allow: str | None
    what: str  # what the values are, for the docs' table (docs/resume.md)
    values: Callable[[dict[str, Any]], dict[str, Any]]
    means: str  # what happens when resume_allow lists it (or why it cannot change)


def config_keys(section: str, *keys: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``values`` of ``Compared``: ``keys`` (dotted) of the resolved config under ``payload[section]``."""
    return lambda payload: {key: at(payload.get(section, {}), key) for key in keys}


def file_keys(section: str, *keys: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """:func:`config_keys` of keys naming files, compared as the files they name: ``./x``, ``x``, an absolute path
    or a link to it are one file (where it exists; a hub name or a missing file as written)."""

    def values(payload: dict[str, Any]) -> dict[str, Any]:
        out = config_keys(section, *keys)(payload)
        for key, path in out.items():
            if isinstance(path, str) and os.path.exists(os.path.expanduser(path)):
                out[key] = os.path.realpath(os.path.expanduser(path))
        return out

    return values


MUON_SETTINGS = ("momentum", "nesterov", "ns_steps", "weight_decay", "adjust_lr")  # ns_dtype: how, not what
# the settings each learning-rate schedule reads (pretrain.optim.lr_lambda)
SCHEDULE_SETTINGS = {
    "cosine": ("warmup_steps", "min_lr_ratio", "decay_steps"),
    "linear": ("warmup_steps", "min_lr_ratio", "decay_steps"),
    "wsd": ("warmup_steps", "min_lr_ratio", "decay_steps", "cooldown_fraction"),
    "inverse_sqrt": ("warmup_steps", "min_lr_ratio"),
    "constant": ("warmup_steps",),
}
DECAY_STEPS = "optim.decay_steps (default trainer.max_steps)"


def optimizer_values(section: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``values`` of ``Compared``: the optimizer (``optim`` under ``payload[section]``) but its learning rates."""

    def values(payload: dict[str, Any]) -> dict[str, Any]:
        o = at(payload, f"{section}.optim")
        if o is MISSING:
            return {}
        out = {f"optim.{k}": o.get(k, MISSING) for k in ("name", "betas", "eps", "weight_decay")}
        if o.get("name") == "muon":
            out |= {f"optim.muon.{k}": o["muon"].get(k, MISSING) for k in MUON_SETTINGS}
        return out

    return values


def lr_schedule_values(section: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``values`` of ``Compared``: the learning-rate schedule -- base rates and the settings the schedule reads,
    ``decay_steps`` as it takes effect (``trainer.max_steps`` when unset)."""

    def values(payload: dict[str, Any]) -> dict[str, Any]:
        o = at(payload, f"{section}.optim")
        if o is MISSING:
            return {}
        out = {"optim.lr": o["lr"], "optim.schedule": o["schedule"]}
        for key in SCHEDULE_SETTINGS.get(o["schedule"], ()):
            if key == "decay_steps":
                out[DECAY_STEPS] = o["decay_steps"] or at(payload, f"{section}.trainer.max_steps")
            else:
                out[f"optim.{key}"] = o[key]
        if o.get("name") == "muon":
            out["optim.muon.lr"] = o["muon"]["lr"]
        return out

    return values


def compare_for_resume(
    table: Sequence[Compared],
    saved: dict[str, Any],
    current: dict[str, Any],
    allowed: Sequence[str],
    ckpt: str | Path,
) -> list[str]:
    """The ``resume_allow`` entries of ``table`` whose values differ between the checkpoint's section ``saved``
    and the run's ``current`` (a warning says what each means); ``ValueError`` in one line naming every key
    that differs with both values, when any entry is not allowed. Values an older checkpoint does not record
    are not compared."""
    refused: list[tuple[Compared, list[str]]] = []
    applied: list[tuple[Compared, list[str]]] = []
    for entry in table:
        before, after = entry.values(saved), entry.values(current)
        diffs = [
            f"{path}: checkpoint {_shown(a)} vs config {_shown(b)}"
            for key, value in after.items()
            if before.get(key, MISSING) is not MISSING
            for path, a, b in _differences(key, _canonical(before[key]), _canonical(value))
        ]
        if not diffs:
            continue
        if entry.allow is not None and entry.allow in allowed:
            applied.append((entry, diffs))
        else:
            refused.append((entry, diffs))
    if refused:
        allow = sorted({e.allow for e, _ in refused if e.allow is not None})
        fixed = [e.what for e, _ in refused if e.allow is None]
        remedy = "resume with the checkpoint's settings, or start a new run (name=NEW or resume=null)"
        if allow and not fixed:  # where a change nothing allows is refused too, resume_allow would not help
            remedy += (
                f", or pass resume_allow=[{','.join(allow)}] ("
                + "; ".join(f"{e.allow}: {e.means}" for e, _ in refused if e.allow is not None)
                + ")"
            )
        if fixed:
            remedy += f" ({' and '.join(fixed)} cannot change within a run{', whatever resume_allow lists' * bool(allow)})"
        listed = "; ".join(d for _, diffs in refused for d in diffs)
        raise InputError(f"cannot resume {ckpt}: {listed}; {remedy}")
    for entry, diffs in applied:  # only once the resume goes ahead
        warnings.warn(
            f"resuming {ckpt} although {'; '.join(diffs)} (resume_allow=[{entry.allow}]): {entry.means}",
            stacklevel=2,
        )
    return [entry.allow for entry, _ in applied if entry.allow is not None]


def _differences(path: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(path, a's, b's)`` of the leaves where ``a`` and ``b`` differ (``path.key``, ``path[i]``), or the whole
    values where their shapes differ."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() | b.keys())
        return [d for k in keys for d in _differences(f"{path}.{k}", a.get(k), b.get(k))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(f"{path}[{i}]", x, y)]
    return [(path, a, b)]


def _canonical(value: Any) -> Any:
    """Equal for equal configs however they were written (tuples as lists, 1 as 1.0, key order)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def strategy_reads(strategy: str, ckpt: Path) -> bool:
    """Whether the Trainer under ``strategy`` restores checkpoint ``ckpt`` itself (FSDP, DDP and one device read
    single files and DCP directories, DeepSpeed only its own directories)."""
    found = kind(ckpt)
    if strategy == "deepspeed":
        return found == "deepspeed"
    return found in ("file", "dcp")


def check_resumable(strategy: str, ckpt: Path) -> None:
    """``InputError`` naming the strategy to use when the Trainer under ``strategy`` cannot restore ``ckpt``."""
    if strategy_reads(strategy, ckpt):
        return
    if kind(ckpt) == "deepspeed":
        raise InputError(
            f"resume={ckpt} is a DeepSpeed checkpoint directory; resume it with strategy.name=deepspeed"
        )
    raise InputError(
        f"resume={ckpt} is not a DeepSpeed checkpoint, which strategy deepspeed cannot restore; use "
        "strategy.name=fsdp or ddp"
    )


def apply_resume_changes(module: Any, checkpoint: dict[str, Any]) -> None:
    """In ``on_load_checkpoint`` of ``module``: what its ``resume_changes`` (the ``resume_allow`` entries that
    differ) change in the state about to be restored. ``optimizer``: no optimizer state (Lightning then loads
    none; the sharded strategies ask ``lightning_compat.fresh_optimizer``), nor the guard's snapshot of it."""
    if "optimizer" in getattr(module, "resume_changes", ()):
        checkpoint["optimizer_states"] = []
        guard = checkpoint.get("callbacks", {}).get("StepGuard")
        if isinstance(guard, dict):
            guard.pop("snapshot", None)


def restart_schedules(module: Any, base_lrs: Sequence[float]) -> None:
    """In ``on_train_start``, after a restore: with ``resume_allow=[optimizer]`` or ``[lr_schedule]``, the learning
    rate from the config's base rates ``base_lrs`` (one per parameter group) at the restored step, instead of the
    checkpoint's rates (``LambdaLR`` restores its ``base_lrs``, the optimizer its groups' ``lr``)."""
    if not {"optimizer", "lr_schedule"} & set(getattr(module, "resume_changes", ())):
        return
    for config in module.trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        rates = [
            base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, base_lrs, strict=True)
        ]
        for group, base, lr in zip(scheduler.optimizer.param_groups, base_lrs, rates, strict=True):
            group["initial_lr"], group["lr"] = base, lr
        scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": list(base_lrs), "_last_lr": rates})
