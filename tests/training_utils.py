"""Helpers of the training tests (plain functions; the ``tiny_world`` fixture is in ``conftest.py``): tiny recipes
(d_model 32, 2 layers) over that world, a runner for the ``pretrain`` CLI in a subprocess, metric readers."""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from pretrain.checkpoint import read

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"

TINY_MODEL = {
    "gpt": {"arch": "decoder", "n_layer": 2, "position": "learned", "init": "gpt2"},
    "bert": {
        "arch": "encoder",
        "n_layer": 2,
        "norm_position": "post",
        "embedding_norm": True,
        "activation": "gelu",
        "mlm_head_transform": True,
        "lm_head_bias": True,
        "init": "bert",
    },
    "t5": {
        "arch": "encoder-decoder",
        "n_layer": 2,
        "n_decoder_layer": 1,
        "norm": "rmsnorm",
        "norm_bias": False,
        "position": "relative",
        "activation": "geglu_tanh",
        "mlp_bias": False,
        "attn_bias": False,
        "attn_scale": "none",
        "tie_embeddings": False,
        "init": "t5",
        "pad_token_id": 0,
        "decoder_start_token_id": 0,
        "eos_token_id": 2,
    },
    "modernbert": {  # ModernBERT's layout: layer 0 global, layer 1 local
        "arch": "encoder",
        "n_layer": 2,
        "norm_bias": False,
        "embedding_norm": True,
        "activation": "geglu",
        "mlp_bias": False,
        "attn_bias": False,
        "position": "rope",
        "rope_theta": 160000.0,
        "global_attn_every_n_layers": 2,
        "local_attention_window": 9,
        "local_rope_theta": 10000.0,
        "mlm_head_transform": True,
        "mlm_head_bias": False,
        "lm_head_bias": True,
    },
}
OBJECTIVE = {"gpt": "clm", "bert": "mlm", "t5": "span_corruption", "modernbert": "mlm"}


def tiny_recipe(directory: Path, world: dict[str, Path], kind: str = "gpt", **sections) -> Path:
    """A recipe YAML for a tiny ``kind`` (gpt/bert/t5) model on ``world``; ``sections`` are merged in
    (e.g. ``trainer={"max_steps": 10}``)."""
    body = {
        "defaults": ["trainer/cpu", "optim/tiny"],
        "name": f"tiny-{kind}",
        "run_dir": str(directory / "run"),
        "seed": 7,
        "model": {
            "vocab_size": 512,
            "d_model": 32,
            "n_head": 2,
            "d_ff": 64,
            "max_seq_len": 64,
            "dropout": 0.0,
            **TINY_MODEL[kind],
        },
        "objective": {"name": OBJECTIVE[kind]},
        "tokenizer": {"path": str(world["tokenizer"])},
        "data": {
            "sources": [{"name": "tiny", "prepared": str(world["data"])}],
            "seq_len": 32,
            "micro_batch_size": 4,
        },
        "optim": {"warmup_steps": 2},
        "trainer": {
            "max_steps": 10,
            "val_check_interval": 5,
            "limit_val_batches": 2,
            "log_every_n_steps": 1,
            "progress_bar": False,
        },
        # no curves.png: ~1.4 CPU-s of matplotlib per fit, over the suite's hundreds; the tests that read it ask
        "logger": {"wandb": {"enabled": False}, "csv": True, "curves": False},
        "checkpoint": {"every_n_steps": 5, "save_top_k": 1},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    path = directory / f"tiny-{kind}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def one_error_line(capsys, *args) -> str:
    """The one ``pretrain VERB: error: ...`` line of an in-process ``pretrain *args`` that exits 2 with no traceback
    (progress bars aside)."""
    from pretrain.cli import main

    status = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"pretrain {args[0]}: error: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretrain", *args]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment of a CLI subprocess: 1 thread per process (deterministic, no oversubscription), no network,
    and its own W&B service (as from a fresh shell: not the one an in-process test of this session started)."""
    inherited = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    return {**inherited, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", **extra}


def run_cli(
    *args: str, cwd: Path = REPO_ROOT, timeout: float = 600, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """Run ``pretrain *args``; on an unexpected status the failure shows the output."""
    proc = subprocess.run(
        cli_command(*args),
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pretrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


class Background:
    """``pretrain *args`` running in the background (e.g. a reference run next to the one under test)."""

    def __init__(self, *args: str, log: Path, **env: str):
        self.args, self.log = args, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cli_command(*args), cwd=REPO_ROOT, env=cli_env(**env), stdout=out, stderr=subprocess.STDOUT
            )

    def wait(self, timeout: float = 600) -> None:
        if self.proc.wait(timeout) != 0:
            raise AssertionError(
                f"pretrain {' '.join(self.args)} exited {self.proc.returncode}:\n{self.log.read_text()}"
            )


def launch_metrics(run_dir: Path) -> list[list[dict[str, str]]]:
    """Rows of each ``logs/version_*/metrics.csv`` of a run (one version per launch), in launch order; a killed
    launch that never flushed its file has none."""
    versions = sorted((run_dir / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    launches = []
    for version in versions:
        rows = []
        if (version / "metrics.csv").is_file():
            with open(version / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
        launches.append(rows)
    return launches


def read_metrics(run_dir: Path, newest_only: bool = False) -> list[dict[str, str]]:
    """Rows of every launch of a run (or of the newest one only), in launch order."""
    launches = launch_metrics(run_dir)
    return [row for rows in (launches[-1:] if newest_only else launches) for row in rows]


def metric_by_step(rows: list[dict[str, str]], name: str) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name) not in (None, "")}


def checkpoint_step(path: Path) -> int:
    """``global_step`` stored in a checkpoint file or sharded directory, or -1 while there is none."""
    from pretrain.checkpoint.resume import checkpoint_step as stored_step

    try:
        return stored_step(Path(path)) if Path(path).is_dir() else int(read(path, mmap=True)["global_step"])
    except (FileNotFoundError, ValueError):
        return -1


def fit_and_signal(
    recipe: Path,
    run_dir: Path,
    at_step: int,
    signum: int = signal.SIGKILL,
    *overrides: str,
    whole_group: bool = True,
    rank: int | None = None,
    timeout: float = 600,
) -> tuple[int, int, str]:
    """Start ``pretrain fit recipe *overrides`` and send ``signum`` as soon as ``last.ckpt`` holds step >=
    ``at_step``: to its whole process group (every DDP rank), to the launching process (rank 0) only
    (``whole_group=False``) or to the process of local rank ``rank`` only. The signal lands wherever training
    then is. Returns (that step, the exit status of the launching process, the output). A run that finished
    before the signal reached it (status 0: on a loaded machine the few steps left can end while the checkpoint
    is being read), or whose signal landed only after its last step had been checkpointed (it ended during
    shut-down, with nothing left to resume), is started again from an empty ``run_dir``, up to 3 times."""
    from pretrain import config

    max_steps = config.load(recipe, list(overrides))[0].trainer.max_steps
    for _ in range(3):
        step, status, output = _signal_once(
            recipe, run_dir, at_step, signum, overrides, whole_group, rank, timeout
        )
        saved = [checkpoint_step(p) for p in (run_dir / "checkpoints").glob("*.ckpt")]
        if status != 0 and max(saved, default=-1) < max_steps:
            return step, status, output
        shutil.rmtree(run_dir)
    raise AssertionError(f"3 runs of {recipe} finished before the signal at step {at_step} stopped them")


def _signal_once(
    recipe: Path,
    run_dir: Path,
    at_step: int,
    signum: int,
    overrides: tuple[str, ...],
    whole_group: bool,
    rank: int | None,
    timeout: float,
) -> tuple[int, int, str]:
    last = run_dir / "checkpoints" / "last.ckpt"
    log_path = run_dir.parent / f"signalled-{signal.Signals(signum).name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cli_command("fit", str(recipe), *overrides),
            cwd=REPO_ROOT,
            env=cli_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                # the run (every rank) is stopped while its checkpoint is read and the signal sent: on a loaded
                # machine a read took longer than the tiny steps left, and runs ended between two polls
                with stopped(proc.pid):
                    step = checkpoint_step(last)
                    if step >= at_step:
                        with contextlib.suppress(ProcessLookupError):  # it has just ended: its status tells
                            if rank:
                                os.kill(rank_pid(proc.pid, rank), signum)
                            else:
                                (os.killpg if whole_group and rank is None else os.kill)(proc.pid, signum)
                if step >= at_step:
                    status = proc.wait(max(1.0, deadline - time.monotonic()))
                    if signum == signal.SIGKILL and whole_group:
                        # a killed job loses every process it started (a scheduler kills the whole job); the W&B
                        # service runs in its own session and would hold the run id the resume continues. Only
                        # the service this run started (``--pid <its pid>``) goes: others belong to other tests.
                        subprocess.run(
                            ["pkill", "-9", "-f", f"wandb-core.*--pid {proc.pid}( |$)"], check=False
                        )
                    return step, status, log_path.read_text()
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    raise AssertionError(
        f"the run ended (status {proc.returncode}) before step {at_step} could be signalled; see {log_path}"
    )


@contextlib.contextmanager
def stopped(group: int) -> Iterator[None]:
    """Process group ``group`` stopped (SIGSTOP) for the block, continued after it (a signal sent meanwhile is
    delivered then; SIGKILL at once)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGCONT)


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of the process Lightning's launcher ``launcher`` started for local rank ``rank``."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of local rank {rank} among {children}")


def fit_and_kill(recipe: Path, run_dir: Path, kill_at_step: int, timeout: float = 600) -> int:
    """SIGKILL every rank of ``pretrain fit recipe`` once ``last.ckpt`` holds step >= ``kill_at_step``;
    returns that step."""
    return fit_and_signal(recipe, run_dir, kill_at_step, timeout=timeout)[0]


def launch_losses(run_dir: Path) -> list[dict[int, float]]:
    """``train/loss`` by step of each launch of a run, in launch order."""
    return [metric_by_step(rows, "train/loss") for rows in launch_metrics(run_dir)]


def model_weights(checkpoint: Path) -> dict:
    """The ``state_dict`` of a checkpoint file, or of a sharded directory (DCP: whole tensors)."""
    if Path(checkpoint).is_dir():
        from pretrain.checkpoint import dcp

        return dcp.read(checkpoint, lambda key: key.startswith("state_dict."))["state_dict"]
    return read(checkpoint)["state_dict"]


def wandb_records(run_file: Path) -> list:
    """Records of an offline W&B run file (``run-<id>.wandb``: a header, then LevelDB-log framed protobufs
    in 32 KiB blocks; record types FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    pos, chunks, records = 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / zero padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, *args: str, world_size: int = 2, log_dir: Path, timeout: float = 900) -> None:
    """Run ``python script *args`` as ``world_size`` ranks of one process group on this machine (the variables
    torchrun sets; Lightning then creates no processes itself). Fails with the logs of every rank."""
    env = cli_env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), NODE_RANK="0"
    )
    procs = []
    for rank in range(world_size):
        with open(log_dir / f"rank{rank}.log", "w") as log:  # the child keeps its own handle
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    cwd=REPO_ROOT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        logs = "\n".join(
            f"--- rank {r} ---\n{(log_dir / f'rank{r}.log').read_text()[-4000:]}" for r in range(world_size)
        )
        raise AssertionError(f"{script.name} exited {codes}:\n{logs}")


def record_sample_indices() -> tuple:
    """Patches (``[(owner, name, patched)]``, for ``monkeypatch.setattr`` or plain assignment) that append every
    training micro-batch's sample indices (stream positions, ``Sample.index``) to
    ``<run_dir>/samples.rank<r>.jsonl`` as ``[global_step, [indices]]``, when the training loop receives the batch
    (not when it is prefetched)."""
    import json

    import torch

    from pretrain.datamodules.pretrain import ObjectiveCollate
    from pretrain.training.module import PretrainData

    collate, before_transfer = ObjectiveCollate.__call__, PretrainData.on_before_batch_transfer

    def collate_with_indices(self, samples):
        batch = collate(self, samples)
        batch["sample_index"] = torch.tensor([s.index for s in samples])
        return batch

    def record_indices(self, batch, dataloader_idx):
        indices = batch.pop("sample_index", None)
        trainer = self.trainer
        if indices is not None and trainer is not None and trainer.training:
            out = Path(trainer.default_root_dir) / f"samples.rank{trainer.global_rank}.jsonl"
            with open(out, "a") as f:
                f.write(json.dumps([trainer.global_step, indices.tolist()]) + "\n")
        return before_transfer(self, batch, dataloader_idx)

    return (
        (ObjectiveCollate, "__call__", collate_with_indices),
        (PretrainData, "on_before_batch_transfer", record_indices),
    )


def samples_by_step(run_dir: Path, files: str | None = None) -> dict[int, list[int]]:
    """``{global step: sorted sample indices read in it, all ranks and micro-batches}`` from the files
    :func:`record_sample_indices` writes (every launch of the run); ``files``: a glob of the ranks' files to read
    (one per data-parallel rank, under tensor parallelism)."""
    import json

    steps: dict[int, list[int]] = {}
    for path in sorted(run_dir.glob(files or "samples.rank*.jsonl")):
        for line in path.read_text().splitlines():
            step, indices = json.loads(line)
            steps.setdefault(step, []).extend(indices)
    return {step: sorted(indices) for step, indices in sorted(steps.items())}
