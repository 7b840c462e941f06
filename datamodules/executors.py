"""``prepare`` split into tasks run by datatrove's executors (local processes, a SLURM job array, a Ray cluster).

The input stream (files in order) is cut into ``tasks`` contiguous runs of about equal bytes (``task_pieces``): at
file boundaries, and inside a file larger than one task's share when its convention allows byte ranges (plain
text with ``line``/``blank_line``, JSONL; not gzipped: ``pretrain.datamodules.corpus.document_start`` moves each
cut to the next document start). Task ``r`` tokenizes its pieces exactly as ``prepare`` does into
``train-r``/``val-r`` shards in a staging directory next to ``out_dir``, with each document keyed by its position
``(file, document in file)`` (``pretrain.datamodules.prepare``): a piece that starts inside a file needs the number
of documents before it, so a *scan* stage first counts the documents (and lines, for messages) of every piece
of a split file. With ``dedup="exact"`` the scan stage hashes every document; the launcher keeps the first
occurrence of each hash in stream order and gives each task the positions it drops, so the output is
single-process prepare's whatever the task count (the launcher holds 32 bytes per document meanwhile).

Each task writes its shards under temporary names, renames them, then writes its manifest ``task-r.json``
(counts, the content hashes of the files whose first piece it holds, and the *spec* it ran: pieces, file
stats, first positions, the digest of its drop list) -- so a crashed task leaves no shard under a final name,
and a shard without a manifest is never used. datatrove marks the task complete (``logs/completions``); a
rerun skips complete tasks whose spec is unchanged (same pieces, files of the same size and modification
time, same drops) and redoes the others. When every task is complete the shards move into a fresh directory
that replaces ``out_dir`` atomically, with a ``meta.json`` listing them in order: concatenated, the train (val)
shards are byte for byte the single-process ``train.bin`` (``val.bin``), and ``meta.json`` has the same cache
key and counts. The datamodule reads such a directory as one source (``prepare.split_prefixes``).

Why datatrove: it is the engine pretraining corpora are already processed with (FineWeb), its three executors
share one interface, and its completion markers give "rerun only what failed" on each of them; Ray Data would
add a second execution model for the same job, and has no SLURM launcher. (Its own exact-dedup steps keep a
document by priority within its readers' files, not the first in our stream order, hence the scan stage.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import json
import math
import os
import select
import shlex
import shutil
import signal
import sys
import sysconfig
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
from datatrove.pipeline.base import PipelineStep

from pretrain.datamodules.corpus import (
    CorpusStats,
    InvalidUTF8Error,
    Source,
    document_start,
    iter_documents,
)
from pretrain.datamodules.prepare import (
    META_FILE,
    SPLITS,
    Plan,
    build_notes,
    corpus_meta,
    plan,
    previous_meta,
    reuse_or_clear,
    text_digest,
)
from pretrain.errors import InputError
from pretrain.io import atomic_write_text, exclusive, replace_path

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pretrain.datamodules.prepare import CorpusSettings

EXECUTORS = ("local", "slurm", "ray")
_STATS = ("documents", "skipped_empty", "invalid_utf8_lines", "bytes_read", "null_texts", "empty_sources")


class Piece(NamedTuple):
    """Bytes ``[start, end)`` of input file ``file`` (``end=None``: to its end); both ends are document starts."""

    file: int
    start: int = 0
    end: int | None = None


def task_pieces(
    sizes: Sequence[int], tasks: int, cut_at: Callable[[int, int], int | None] | None = None
) -> list[list[Piece]]:
    """The input stream (files of ``sizes`` bytes, in order) as ``tasks`` contiguous runs of pieces of about
    ``sum(sizes) / tasks`` bytes each (some empty when there is less to share). A cut falling in a file larger
    than that share moves to ``cut_at(file, offset)``, the next document start (None: the file cannot be cut
    there); any other cut moves to the nearer end of its file."""
    n, total = len(sizes), sum(sizes) or 1
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    cuts = [(0, 0)]
    for r in range(1, tasks):
        goal = total * r / tasks
        f = next((k for k in range(n) if offsets[k] <= goal < offsets[k + 1]), n)
        cut = (n, 0)
        if f < n:
            large = sizes[f] > total / tasks
            inside = cut_at(f, math.ceil(goal - offsets[f])) if large and cut_at is not None else None
            if inside is not None:
                cut = (f, inside)
            else:
                cut = (f, 0) if goal - offsets[f] < sizes[f] / 2 else (f + 1, 0)
        cuts.append(max(cut, cuts[-1]))
    cuts.append((n, 0))
    runs = []
    for (fa, oa), (fb, ob) in itertools.pairwise(cuts):
        last = fb if ob > 0 else fb - 1
        pieces = [
            Piece(f, oa if f == fa else 0, ob if f == fb else None) for f in range(fa, min(last, n - 1) + 1)
        ]
        runs.append([p for p in pieces if p.end is None or p.end > p.start])  # two cuts at one start: empty
    return runs


def _source(spec: dict, piece: Sequence, first_line: int = 1) -> Source:
    _, start, end = piece
    return Source(**spec, start=start, end=end, first_line=first_line)


def _newlines(source: Source) -> int:
    """Line breaks in the source's byte range."""
    count, left = 0, source.size
    with open(source.location, "rb") as f:
        f.seek(source.start)
        while left > 0 and (block := f.read(min(1 << 20, left))):
            count += block.count(b"\n")
            left -= len(block)
    return count


def _line_in_file(err: InvalidUTF8Error, source: Source) -> InvalidUTF8Error:
    """``err`` raised reading ``source`` from line 1 of its range, renumbered to the line in the whole file."""
    where, _, line = err.location.rpartition(":")
    head = Source(source.kind, source.location, source.split, 0, source.start)
    return InvalidUTF8Error(f"{where}:{int(line) + _newlines(head)}", err.detail)


class ScanTask(PipelineStep):
    """datatrove step: count (and with ``hashes``, hash) the documents of task ``rank``'s pieces to scan."""

    name = "scan (pretrain prepare)"
    type = "Tokenizer"

    def __init__(self, staging: str, sources: list[dict], specs: list[dict], read_args: dict, hashes: bool):
        super().__init__()
        self.staging, self.sources, self.specs = staging, sources, specs
        self.read_args, self.hashes = read_args, hashes
        self.launcher: int | None = None  # set for the local executor: its workers die with this process

    def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Any:
        die_with_launcher(self.launcher)
        scan = Path(self.staging) / "scan"
        spec, counts, lines, digests = self.specs[rank], [], [], []
        for piece in spec["pieces"]:
            source = _source(self.sources[piece[0]], piece)
            documents = 0
            try:
                for doc in iter_documents([source], **self.read_args):
                    documents += 1
                    if self.hashes:
                        digests.append(text_digest(doc))
            except InvalidUTF8Error as err:
                raise _line_in_file(err, source) from None
            counts.append(documents)
            lines.append(_newlines(source))
        table = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, 16)
        tmp = scan / f"hashes-{rank:05d}.{uuid.uuid4().hex[:8]}.npy"
        np.save(tmp, table)
        os.replace(tmp, scan / f"hashes-{rank:05d}.npy")
        manifest = {"spec": spec, "documents": counts, "lines": lines}
        atomic_write_text(scan / f"task-{rank:05d}.json", json.dumps(manifest))
        return data


class TokenizeTask(PipelineStep):
    """datatrove step: task ``rank`` of ``prepare`` (see the module docstring); its spec is ``spec-r.json``."""

    name = "tokenize (pretrain prepare)"
    type = "Tokenizer"

    def __init__(
        self, staging: str, tokenizer_json: str, settings: dict, sources: list[dict], build_args: dict
    ):
        super().__init__()
        self.staging, self.tokenizer_json, self.settings = staging, tokenizer_json, settings
        self.sources, self.build_args = sources, build_args
        self.launcher: int | None = None  # set for the local executor: its workers die with this process

    def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Any:
        from tokenizers import Tokenizer

        from pretrain.datamodules.indexed import IndexedWriter
        from pretrain.datamodules.prepare import _input_info, build_shard

        die_with_launcher(self.launcher)
        staging, suffix = Path(self.staging), f"-{rank:05d}"
        spec = json.loads((staging / f"spec{suffix}.json").read_text())
        pieces = spec["pieces"]
        sources = [_source(self.sources[p[0]], p, line) for p, line in zip(pieces, spec["first_lines"])]
        skip = None
        if spec["skip"] is not None:
            skip = set(map(tuple, np.load(staging / f"skip{suffix}.npy").tolist()))
        partial = staging / f"partial-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        try:
            if not pieces:  # more tasks than pieces: empty shards keep the numbering simple
                for split in SPLITS:
                    with IndexedWriter(partial / f"{split}{suffix}", self.build_args["dtype"]):
                        pass
                splits, stats, duplicates = (
                    {s: {"documents": 0, "tokens": 0} for s in SPLITS},
                    CorpusStats(),
                    0,
                )
            else:
                locations = [self.sources[p[0]]["location"] for p in pieces]
                task_plan = plan(
                    locations, Tokenizer.from_str(self.tokenizer_json), hash_inputs=False, **self.settings
                )
                args = {k: v for k, v in self.build_args.items() if k != "dtype"}
                positions = [tuple(p) for p in spec["positions"]]
                splits, stats, duplicates = build_shard(
                    partial, suffix, task_plan, sources, positions, skip=skip, **args
                )
            for split in SPLITS:
                for ext in (".bin", ".idx"):
                    os.replace(partial / f"{split}{suffix}{ext}", staging / f"{split}{suffix}{ext}")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        owned = [[p[0], _input_info(Source(**self.sources[p[0]]), {})] for p in pieces if p[1] == 0]
        manifest = {
            "spec": spec,
            "inputs": owned,
            "splits": splits,
            "duplicates": duplicates,
            "stats": {k: getattr(stats, k) for k in _STATS},
            "first_invalid_utf8": stats.first_invalid_utf8,
            "first_null_text": stats.first_null_text,
        }
        atomic_write_text(staging / f"task{suffix}.json", json.dumps(manifest))
        self.stat_update("documents", value=stats.documents)
        return data


def die_with_launcher(launcher: int | None) -> None:
    """In a worker process of the local executor (not the launcher itself, which runs the tasks when they run one
    at a time): end when the launcher ends, so that a killed ``pretrain prepare`` -- SIGKILL included -- leaves no
    task running on. A thread waits on the launcher's pidfd (or polls it each second) and then kills this process.
    (The parent's death signal would not do: a worker's parent is the fork server, which waits for its workers.)"""
    if launcher is not None and launcher != os.getpid():
        _watch(launcher)


@functools.cache
def _watch(launcher: int) -> None:
    """Start the thread of ``die_with_launcher`` (once per worker process)."""

    def wait() -> None:
        try:
            fd = os.pidfd_open(launcher)  # Linux >= 5.3: readable once the process has ended
            select.select([fd], [], [])
        except (AttributeError, OSError):  # no pidfd (or the launcher is already gone): poll
            with contextlib.suppress(PermissionError):
                while True:
                    os.kill(launcher, 0)
                    time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="pretrain-launcher-watch", daemon=True).start()


def _die_with_parent() -> None:
    """SIGKILL when the parent process dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@functools.cache
def _forks_die_with_this_process() -> None:
    """Processes ``multiprocess`` forks from this one get ``_die_with_parent`` (registered once): datatrove's
    manager process, which would otherwise outlive a killed launcher, and with it the fork server."""
    import multiprocess.util

    multiprocess.util.register_after_fork(_die_with_parent, lambda _: _die_with_parent())


def build_executor(kind: str, pipeline: list, tasks: int, workers: int, logging_dir: Path, options: dict):
    """datatrove's executor ``kind`` running ``pipeline`` as ``tasks`` tasks, ``workers`` at a time (also
    ``pretrain ladder``'s); ``options`` go to it (SLURM: partition, time, job_name, ...)."""
    if kind == "local":
        from datatrove.executor import LocalPipelineExecutor

        _forks_die_with_this_process()
        for step in pipeline:
            if hasattr(step, "launcher"):  # a step calling die_with_launcher(self.launcher) first
                step.launcher = os.getpid()

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

        # the array task runs datatrove's `launch_pickled_pipeline` script: from this environment's scripts
        # folder, which is on no PATH when this process was started as venv/bin/pretrain without activating it
        scripts = sysconfig.get_path("scripts")
        options = {
            "time": "24:00:00",
            "partition": "local",
            "job_name": "pretrain-prepare",
            "env_command": f"export PATH={shlex.quote(scripts)}:$PATH",
            **options,
        }
        return SlurmPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir), **options
        )
    raise ValueError(f"executor={kind!r}; choose one of {EXECUTORS}")


def _forget(directory: Path, logs: Path, rank: int) -> None:
    """Task ``rank`` runs again: its manifest and datatrove's completion mark are dropped."""
    (directory / f"task-{rank:05d}.json").unlink(missing_ok=True)
    (logs / "completions" / f"{rank:05d}").unlink(missing_ok=True)


def _forget_changed(directory: Path, logs: Path, specs: list[dict]) -> None:
    """Forget the tasks whose manifest in ``directory`` records another spec than now (or none)."""
    for rank, spec in enumerate(specs):
        manifest = directory / f"task-{rank:05d}.json"
        if not manifest.is_file() or json.loads(manifest.read_text())["spec"] != spec:
            _forget(directory, logs, rank)


def shard_problem(staging: Path, rank: int) -> str | None:
    """What is wrong with finished task ``rank``'s shards in ``staging`` (missing, truncated, or other counts than
    its manifest records), or None."""
    from pretrain.datamodules.indexed import IndexedDataset

    manifest = json.loads((staging / f"task-{rank:05d}.json").read_text())
    for split in SPLITS:
        prefix = staging / f"{split}-{rank:05d}"
        try:
            shard = IndexedDataset(prefix)
        except (FileNotFoundError, InputError) as err:
            return str(err).split(";")[0]
        counts = manifest["splits"][split]
        if (len(shard), shard.num_tokens) != (counts["documents"], counts["tokens"]):
            return (
                f"{prefix}.bin holds {len(shard)} documents / {shard.num_tokens} tokens, its task wrote "
                f"{counts['documents']} / {counts['tokens']}"
            )
    return None


def _forget_damaged(staging: Path, tasks: int) -> None:
    """Finished tasks whose shards were lost or damaged since (a truncated copy, a deleted file) run again."""
    for rank in range(tasks):
        if (staging / f"task-{rank:05d}.json").is_file() and (problem := shard_problem(staging, rank)):
            warnings.warn(f"task {rank}'s shards are damaged ({problem}); running it again", stacklevel=3)
            _forget(staging, staging / "logs", rank)


def _run(run, staging: Path, directory: Path, tasks: int, executor: str) -> list[int]:
    """Run the executor; the ranks whose manifest is still missing (SLURM: submitted, not yet run)."""
    try:
        run.run()
    except InvalidUTF8Error:
        raise  # the CLI names the setting
    except Exception as err:  # a task's own error, re-raised by the executor
        raise InputError(f"{err} (complete tasks are kept: fix it and rerun the same command)") from err
    missing = [r for r in range(tasks) if not (directory / f"task-{r:05d}.json").is_file()]
    if missing and executor != "slurm":
        raise InputError(
            f"task(s) {missing} of `pretrain prepare` failed (logs: {directory / 'logs' / 'logs'}); fix the cause "
            "and rerun the same command: complete tasks are kept, only these run again"
        )
    return missing


def _remove_other_staging(out_dir: Path, staging: Path) -> None:
    """Remove the staging directories of earlier runs for ``out_dir`` with another task count, tokenizer or
    settings: their tasks can never be assembled into this output (the caller holds ``out_dir``'s lock)."""
    for other in out_dir.parent.glob(f".{out_dir.name}.tasks-*"):
        if other != staging and other.is_dir():
            warnings.warn(
                f"removing {other}: the tasks of an earlier `pretrain prepare --executor` with another --tasks "
                f"count or other settings (this run's tasks are in {staging.name})",
                stacklevel=4,
            )
            shutil.rmtree(other, ignore_errors=True)


def _remove_partial(staging: Path) -> None:
    """Remove what killed tasks left in ``staging``: half-written shard directories and temporary files."""
    for pattern in ("partial-*", "scan/hashes-*.*.npy", "skip-*.*.npy", ".*.tmp", "scan/.*.tmp"):
        for leftover in staging.glob(pattern):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def _scan_specs(runs: list[list[Piece]], stats: list, dedup: bool) -> list[dict] | None:
    """Per task, the pieces whose documents must be counted (pieces of a split file but its last; every
    piece with ``dedup``); None when there are none."""
    split_files = {p.file for run in runs for p in run if p.start > 0}
    last = {p.file: p for run in runs for p in run}
    specs = [[p for p in run if dedup or (p.file in split_files and p != last[p.file])] for run in runs]
    if not any(specs):
        return None
    return [{"pieces": [list(p) for p in ps], "stats": [stats[p.file] for p in ps]} for ps in specs]


def _resolve(staging: Path, runs: list[list[Piece]], stats: list, scans: list[dict] | None, dedup: bool):
    """Each task's spec (first positions and line numbers of its pieces, from the scan) and, with ``dedup``,
    its drop list: the ``(file, ordinal)`` of every document whose hash an earlier one in stream order has."""
    counts: dict[tuple, tuple[int, int]] = {}
    if scans is not None:
        for rank, scan in enumerate(scans):
            done = json.loads((staging / "scan" / f"task-{rank:05d}.json").read_text())
            for piece, docs, lines in zip(scan["pieces"], done["documents"], done["lines"]):
                counts[tuple(piece)] = (docs, lines)
    specs: list[dict[str, Any]] = []
    before: dict[int, tuple[int, int]] = {}  # before[file]: (documents, lines) of its earlier pieces
    for run in runs:
        positions, first_lines = [], []
        for p in run:
            docs, lines = before.get(p.file, (0, 0))
            positions.append([p.file, docs])
            first_lines.append(lines + 1)
            if p.end is not None:
                more = counts[tuple(p)]
                before[p.file] = (docs + more[0], lines + more[1])
        spec: dict[str, Any] = {"pieces": [list(p) for p in run], "stats": [stats[p.file] for p in run]}
        specs.append({**spec, "positions": positions, "first_lines": first_lines, "skip": None})
    if not dedup:
        return specs, [None] * len(runs)
    hashes, keys, owner = [], [], []
    for rank, spec in enumerate(specs):
        table = np.load(staging / "scan" / f"hashes-{rank:05d}.npy")
        hashes.append(table)
        for (f, first), piece in zip(spec["positions"], spec["pieces"]):
            docs = counts[tuple(piece)][0]
            keys.append(np.stack([np.full(docs, f), np.arange(first, first + docs)], axis=1))
        owner.append(np.full(len(table), rank))
    table = np.concatenate(hashes) if hashes else np.empty((0, 16), np.uint8)
    keys_all = np.concatenate(keys) if keys else np.empty((0, 2), np.int64)
    owners = np.concatenate(owner) if owner else np.empty(0, np.int64)
    _, first = np.unique(table.view(np.dtype((np.void, 16))).ravel(), return_index=True)  # first occurrences
    dropped = np.ones(len(table), dtype=bool)
    dropped[first] = False
    drops = [keys_all[dropped & (owners == r)].astype(np.int64) for r in range(len(specs))]
    for spec, drop in zip(specs, drops):
        spec["skip"] = hashlib.sha256(drop.tobytes()).hexdigest()
    return specs, drops


def prepare_in_tasks(
    inputs,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    executor: Literal["local", "slurm", "ray"] = "local",
    tasks: int = 2,
    workers: int = -1,
    executor_options: dict | None = None,
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    force: bool = False,
    **settings: Unpack[CorpusSettings],
) -> dict:
    """``prepare`` (same arguments, same output up to the shard split) in ``tasks`` datatrove tasks, ``workers``
    at a time (-1: all). ``executor_options`` go to the executor (e.g. ``partition``, ``time`` for SLURM).
    Returns ``meta.json`` with ``cache_hit``; under SLURM, which runs the tasks asynchronously, a rerun once a
    job array finished goes on (the scan stage's, then the tokenize stage's) and finally assembles the
    directory (``{"submitted": True, ...}`` until then)."""
    if executor not in EXECUTORS:
        raise InputError(f"executor={executor!r}; choose one of {EXECUTORS}")
    if tasks < 1:
        raise InputError(f"tasks={tasks} must be >= 1")
    out_dir = Path(out_dir).expanduser()
    with exclusive(out_dir, "`pretrain prepare`"):
        old = previous_meta(out_dir)
        cheap = plan(inputs, tokenizer, previous=old, hash_inputs=False, **settings)
        if any(s.kind in ("hf_hub", "hf_disk") for s in cheap.sources):
            raise InputError(
                "--executor splits input files; `datasets` inputs are prepared without --executor"
            )
        if (
            out_dir.exists()
        ):  # a foreign directory is refused; an up-to-date one reused (hashing changed files only)
            full = plan(inputs, tokenizer, previous=old, **settings) if old is not None else cheap
            kept = reuse_or_clear(out_dir, full, force)
            if kept is not None:
                return {**kept, "cache_hit": True}
        document, dedup = cheap.settings["document"], cheap.settings["dedup"] == "exact"
        sources = cheap.sources

        runs = task_pieces(
            [s.size for s in sources], tasks, lambda f, offset: document_start(sources[f], offset, document)
        )
        stats = [i["stat"] for i in cheap.inputs]
        staging_id = hashlib.sha256(
            json.dumps([cheap.settings, cheap.tokenizer_hash, tasks]).encode()
        ).hexdigest()[:12]
        staging = out_dir.with_name(f".{out_dir.name}.tasks-{staging_id}")
        _remove_other_staging(out_dir, staging)
        if executor != "slurm":  # no task of ours runs now (we hold the lock): what killed ones left goes
            _remove_partial(staging)
        (staging / "logs" / "completions").mkdir(parents=True, exist_ok=True)
        described = [{"kind": s.kind, "location": s.location, "split": s.split} for s in sources]
        scans = _scan_specs(runs, stats, dedup)
        if scans is not None:
            (staging / "scan" / "logs" / "completions").mkdir(parents=True, exist_ok=True)
            _forget_changed(staging / "scan", staging / "scan" / "logs", scans)
            read_args = {k: cheap.settings[k] for k in ("document", "text_field", "on_invalid_utf8")}
            step = ScanTask(str(staging), described, scans, read_args, dedup)
            run = build_executor(
                executor, [step], tasks, workers, staging / "scan" / "logs", executor_options or {}
            )
            missing = _run(run, staging, staging / "scan", tasks, executor)
            if missing:
                return {"submitted": True, "stage": "scan", "staging": str(staging), "tasks_pending": missing}
        specs, drops = _resolve(staging, runs, stats, scans, dedup)
        for rank, (spec, drop) in enumerate(zip(specs, drops)):
            if drop is not None:
                tmp = staging / f"skip-{rank:05d}.{uuid.uuid4().hex[:8]}.npy"
                np.save(tmp, drop)
                os.replace(tmp, staging / f"skip-{rank:05d}.npy")
            atomic_write_text(staging / f"spec-{rank:05d}.json", json.dumps(spec))
        _forget_changed(staging, staging / "logs", specs)
        _forget_damaged(staging, tasks)
        step = TokenizeTask(
            str(staging),
            cheap.tokenizer.to_str(),
            cheap.settings,
            described,
            {"dtype": cheap.dtype.name, "batch_docs": batch_docs, "batch_chars": batch_chars},
        )
        run = build_executor(executor, [step], tasks, workers, staging / "logs", executor_options or {})
        missing = _run(run, staging, staging, tasks, executor)
        if missing:
            return {"submitted": True, "stage": "tokenize", "staging": str(staging), "tasks_pending": missing}
        return _assemble(out_dir, staging, cheap, tasks)


def _assemble(out_dir: Path, staging: Path, cheap: Plan, tasks: int) -> dict:
    """Move the finished shards into a new ``out_dir`` with its ``meta.json`` (the single-process cache key).
    Every shard is checked first; a failure moves the shards back into ``staging`` (nothing finished is lost)."""
    for rank in range(tasks):
        if problem := shard_problem(staging, rank):
            _forget(staging, staging / "logs", rank)
            raise InputError(
                f"task {rank} of `pretrain prepare` finished, but its shards are damaged ({problem}); rerun the same "
                "command: that task runs again, the others are kept"
            )
    manifests = [json.loads((staging / f"task-{r:05d}.json").read_text()) for r in range(tasks)]
    owned = {f: info for m in manifests for f, info in m["inputs"]}
    inputs = [owned[f] for f in range(len(cheap.sources))]
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
    moved: list[tuple[Path, Path]] = []
    try:
        for r in range(tasks):
            for split in SPLITS:
                for ext in (".bin", ".idx"):
                    name = f"{split}-{r:05d}{ext}"
                    os.replace(staging / name, tmp / name)
                    moved.append((tmp / name, staging / name))
        atomic_write_text(tmp / "tokenizer.json", cheap.tokenizer.to_str())
        atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2))
        replace_path(tmp, out_dir)
    except BaseException:
        for here, back in moved:  # renames within one directory tree: they cannot fail for want of space
            os.replace(here, back)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return {**meta, "cache_hit": False}
