"""``prepare`` split into tasks run by datatrove's executors (local processes, a SLURM job array, a Ray cluster).

The inputs (files, in stream order) are cut into ``tasks`` contiguous groups of about equal bytes. Task ``r``
tokenizes its group exactly as ``prepare`` does (same documents, same ``(file, document)`` validation key,
``pretrain.datamodules.prepare``) into ``train-r``/``val-r`` shards in a staging directory next to ``out_dir``: it writes
them under temporary names, renames them, then writes its manifest ``task-r.json`` (counts, the content hashes
of its files) -- so a crashed task leaves no shard under a final name, and a shard without a manifest is never
used. datatrove marks the task complete (``logs/completions``); a rerun skips complete tasks whose files are
unchanged (size and modification time as recorded) and redoes the others. When every task is complete the
shards move into a fresh directory that replaces ``out_dir`` atomically, with a ``meta.json`` listing them in
order: concatenated, the train (val) shards are byte for byte the single-process ``train.bin`` (``val.bin``),
and ``meta.json`` has the same cache key. The datamodule reads such a directory as one source
(``prepare.split_prefixes``).

Why datatrove: it is the engine pretraining corpora are already processed with (FineWeb), its three executors
share one interface, and its completion markers give "rerun only what failed" on each of them; Ray Data would
add a second execution model for the same job, and has no SLURM launcher.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal

from datatrove.pipeline.base import PipelineStep
from pretrain.datamodules.corpus import CorpusStats, InvalidUTF8Error, Source
from pretrain.datamodules.prepare import (
    META_FILE,
    SPLITS,
    Plan,
    build_notes,
    corpus_meta,
    plan,
    previous_meta,
    reuse_or_clear,
)
from pretrain.datamodules.storage import atomic_write_text, exclusive, replace_path

EXECUTORS = ("local", "slurm", "ray")


def task_groups(sizes: list[int], tasks: int) -> list[range]:
    """``tasks`` contiguous ranges of file indices, each holding about ``sum(sizes) / tasks`` bytes (some may be
    empty when there are fewer files than tasks)."""
    total = sum(sizes) or 1
    bounds, acc, f = [0], 0, 0
    for r in range(1, tasks):
        goal = total * r / tasks
        while f < len(sizes) and acc + sizes[f] / 2 <= goal:
            acc += sizes[f]
            f += 1
        bounds.append(f)
    bounds.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class TokenizeTask(PipelineStep):
    """datatrove step: task ``rank`` of ``prepare`` (see the module docstring)."""

    name = "tokenize (pretrain prepare)"
    type = "Tokenizer"

    def __init__(
        self,
        staging: str,
        tokenizer_json: str,
        plan_args: dict,
        sources: list[dict],
        groups: list[list[int]],
        build_args: dict,
    ):
        super().__init__()
        self.staging, self.tokenizer_json, self.plan_args = staging, tokenizer_json, plan_args
        self.sources, self.groups, self.build_args = sources, groups, build_args

    def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Any:
        from pretrain.datamodules.prepare import build_shard
        from tokenizers import Tokenizer

        staging = Path(self.staging)
        files = self.groups[rank]
        sources = [Source(**self.sources[f]) for f in files]
        task_plan = (
            plan(
                [s.location for s in sources] or [], Tokenizer.from_str(self.tokenizer_json), **self.plan_args
            )
            if sources
            else None
        )
        suffix = f"-{rank:05d}"
        partial = staging / f"partial-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        try:
            if task_plan is None:  # more tasks than files: empty shards keep the numbering simple
                from pretrain.datamodules.indexed import IndexedWriter

                for split in SPLITS:
                    with IndexedWriter(partial / f"{split}{suffix}", self.build_args["dtype"]):
                        pass
                splits, stats, duplicates, inputs = (
                    {s: {"documents": 0, "tokens": 0} for s in SPLITS},
                    CorpusStats(),
                    0,
                    [],
                )
            else:
                args = {k: v for k, v in self.build_args.items() if k != "dtype"}
                splits, stats, duplicates = build_shard(partial, suffix, task_plan, sources, files[0], **args)
                inputs = task_plan.inputs
            for split in SPLITS:
                for ext in (".bin", ".idx"):
                    os.replace(partial / f"{split}{suffix}{ext}", staging / f"{split}{suffix}{ext}")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        manifest = {
            "files": files,
            "inputs": inputs,
            "splits": splits,
            "duplicates": duplicates,
            "stats": {
                k: getattr(stats, k)
                for k in ("documents", "skipped_empty", "invalid_utf8_lines", "bytes_read", "null_texts")
            },
            "first_invalid_utf8": stats.first_invalid_utf8,
            "first_null_text": stats.first_null_text,
        }
        atomic_write_text(staging / f"task{suffix}.json", json.dumps(manifest))
        self.stat_update("documents", value=stats.documents)
        return data


def _executor(kind: str, pipeline: list, tasks: int, workers: int, logging_dir: Path, options: dict):
    if kind == "local":
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir), **options
        )
    if kind == "ray":
        import ray
        from datatrove.executor import RayPipelineExecutor

        if not ray.is_initialized():  # the cluster of RAY_ADDRESS, else a local one
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        options = {"mem_per_cpu_gb": 1, **options}
        return RayPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir), **options
        )
    if kind == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        options = {"time": "24:00:00", "partition": "local", "job_name": "pretrain-prepare", **options}
        return SlurmPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir), **options
        )
    raise ValueError(f"executor={kind!r}; choose one of {EXECUTORS}")


def _valid_tasks(staging: Path, groups: list[range], current: list[dict]) -> None:
    """Forget complete tasks whose files changed since (their manifest's input stats differ from now)."""
    for rank, files in enumerate(groups):
        manifest = staging / f"task-{rank:05d}.json"
        marker = staging / "logs" / "completions" / f"{rank:05d}"
        if not manifest.is_file():
            marker.unlink(missing_ok=True)
            continue
        done = json.loads(manifest.read_text())
        now = [current[f]["stat"] for f in files]
        if done["files"] != list(files) or [i["stat"] for i in done["inputs"]] != now:
            manifest.unlink()
            marker.unlink(missing_ok=True)


def prepare_in_tasks(
    inputs,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    executor: Literal["local", "slurm", "ray"] = "local",
    tasks: int = 2,
    workers: int = -1,
    executor_options: dict | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    document: str = "blank_line",
    text_field: str = "text",
    split: str = "train",
    on_invalid_utf8: str = "error",
    eos_token: str | None = None,
    dedup: str = "none",
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    force: bool = False,
) -> dict:
    """``prepare`` (same arguments, same output up to the shard split) in ``tasks`` datatrove tasks, ``workers``
    at a time (-1: all). ``executor_options`` go to the executor (e.g. ``partition``, ``time`` for SLURM).
    Returns ``meta.json`` with ``cache_hit``; under SLURM, which runs the tasks asynchronously, a rerun once the
    job array finished assembles the directory (``{"submitted": True, ...}`` until then)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r}; choose one of {EXECUTORS}")
    if tasks < 1:
        raise ValueError(f"tasks={tasks} must be >= 1")
    if dedup != "none":
        raise ValueError(
            "dedup=exact is not supported with --executor yet (dropping a duplicate needs every task's hashes); "
            "prepare this source without --executor, or set its dedup to none"
        )
    out_dir = Path(out_dir).expanduser()
    settings = {
        "val_fraction": val_fraction,
        "seed": seed,
        "document": document,
        "text_field": text_field,
        "split": split,
        "on_invalid_utf8": on_invalid_utf8,
        "eos_token": eos_token,
        "dedup": dedup,
    }
    with exclusive(out_dir, "`pretrain prepare`"):
        cheap = plan(inputs, tokenizer, previous=previous_meta(out_dir), hash_inputs=False, **settings)
        if any(s.kind in ("hf_hub", "hf_disk") for s in cheap.sources):
            raise ValueError(
                "--executor splits input files; `datasets` inputs are prepared without --executor"
            )
        old = previous_meta(out_dir)
        if (
            out_dir.exists()
        ):  # a foreign directory is refused; an up-to-date one reused (hashing changed files only)
            full = plan(inputs, tokenizer, previous=old, **settings) if old is not None else cheap
            kept = reuse_or_clear(out_dir, full, force)
            if kept is not None:
                return {**kept, "cache_hit": True}
        groups = task_groups([s.size for s in cheap.sources], tasks)
        staging_id = hashlib.sha256(
            json.dumps([cheap.settings, cheap.tokenizer_hash, tasks]).encode()
        ).hexdigest()[:12]
        staging = out_dir.with_name(f".{out_dir.name}.tasks-{staging_id}")
        (staging / "logs" / "completions").mkdir(parents=True, exist_ok=True)
        _valid_tasks(staging, groups, cheap.inputs)
        step = TokenizeTask(
            str(staging),
            cheap.tokenizer.to_str(),
            {**settings, "eos_token": cheap.eos},
            [{"kind": s.kind, "location": s.location, "split": s.split} for s in cheap.sources],
            [list(g) for g in groups],
            {"dtype": cheap.dtype.name, "batch_docs": batch_docs, "batch_chars": batch_chars},
        )
        run = _executor(executor, [step], tasks, workers, staging / "logs", executor_options or {})
        try:
            run.run()
        except InvalidUTF8Error:
            raise  # the CLI names the setting
        except Exception as err:  # a task's own error, re-raised by the executor
            raise ValueError(f"{err} (complete tasks are kept: fix it and rerun the same command)") from err
        missing = [r for r in range(tasks) if not (staging / f"task-{r:05d}.json").is_file()]
        if missing and executor == "slurm":
            return {"submitted": True, "staging": str(staging), "tasks_pending": missing}
        if missing:
            raise ValueError(
                f"task(s) {missing} of `pretrain prepare` failed (logs: {staging / 'logs' / 'logs'}); fix the cause and "
                "rerun the same command: complete tasks are kept, only these run again"
            )
        return _assemble(out_dir, staging, cheap, tasks)


def _assemble(out_dir: Path, staging: Path, cheap: Plan, tasks: int) -> dict:
    """Move the finished shards into a new ``out_dir`` with its ``meta.json`` (the single-process cache key)."""
    manifests = [json.loads((staging / f"task-{r:05d}.json").read_text()) for r in range(tasks)]
    inputs = [i for m in manifests for i in m["inputs"]]
    full = Plan(
        cheap.tokenizer,
        cheap.eos,
        cheap.eos_id,
        cheap.dtype,
        cheap.sources,
        inputs,
        cheap.settings,
        cheap.key_for([i["sha256"] for i in inputs]),
    )
    splits = {
        s: {k: sum(m["splits"][s][k] for m in manifests) for k in ("documents", "tokens")} for s in SPLITS
    }
    stats = CorpusStats()
    for m in manifests:
        for k, v in m["stats"].items():
            setattr(stats, k, getattr(stats, k) + v)
        stats.first_invalid_utf8 = stats.first_invalid_utf8 or m["first_invalid_utf8"]
        stats.first_null_text = stats.first_null_text or m["first_null_text"]
    notes = build_notes(full, splits, stats)
    for note in notes:
        warnings.warn(note, stacklevel=3)
    meta = corpus_meta(full, splits, stats, sum(m["duplicates"] for m in manifests), notes)
    meta["shards"] = [f"{r:05d}" for r in range(tasks)]
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        for r in range(tasks):
            for split in SPLITS:
                for ext in (".bin", ".idx"):
                    os.replace(staging / f"{split}-{r:05d}{ext}", tmp / f"{split}-{r:05d}{ext}")
        atomic_write_text(tmp / "tokenizer.json", cheap.tokenizer.to_str())
        atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2))
        replace_path(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return {**meta, "cache_hit": False}
