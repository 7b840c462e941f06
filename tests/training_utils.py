"""Tiny end-to-end world shared by the training tests: a BPE tokenizer and a prepared corpus cut from the shipped
Tiny Shakespeare, tiny recipes (d_model 32, 2 layers), and a runner for the ``pretrain`` CLI in a subprocess."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"

TINY_MODEL = {
    "gpt": {"arch": "decoder", "n_layer": 2, "position": "learned", "init": "gpt2"},
    "bert": {"arch": "encoder", "n_layer": 2, "norm_position": "post", "embedding_norm": True,
             "activation": "gelu", "mlm_head_transform": True, "lm_head_bias": True, "init": "bert"},
    "t5": {"arch": "encoder-decoder", "n_layer": 2, "n_decoder_layer": 1, "norm": "rmsnorm", "norm_bias": False,
           "position": "relative", "activation": "geglu_tanh", "mlp_bias": False, "attn_bias": False,
           "attn_scale": "none", "tie_embeddings": False, "init": "t5", "pad_token_id": 0,
           "decoder_start_token_id": 0, "eos_token_id": 2},
}
OBJECTIVE = {"gpt": "clm", "bert": "mlm", "t5": "span_corruption"}


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict[str, Path]:
    """``{"tokenizer": tokenizer.json, "data": prepared dir, "corpus": text}`` from 200 kB of the shipped corpus."""
    from datamodules.prepare import prepare
    from datamodules.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("tiny_world")
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    tokenizer = root / "tokenizer.json"
    train_bpe([corpus], 512, tokenizer, min_frequency=2, show_progress=False)
    data = root / "data"
    prepare([corpus], tokenizer, data, val_fraction=0.1, progress=False)
    return {"tokenizer": tokenizer, "data": data, "corpus": corpus}


def tiny_recipe(directory: Path, world: dict[str, Path], kind: str = "gpt", **sections) -> Path:
    """A recipe YAML for a tiny ``kind`` (gpt/bert/t5) model on ``world``; ``sections`` are merged in
    (e.g. ``trainer={"max_steps": 10}``)."""
    body = {
        "defaults": ["trainer/cpu", "optim/tiny"],
        "name": f"tiny-{kind}",
        "run_dir": str(directory / "run"),
        "seed": 7,
        "model": {"vocab_size": 512, "d_model": 32, "n_head": 2, "d_ff": 64, "max_seq_len": 64,
                  "dropout": 0.0, **TINY_MODEL[kind]},
        "objective": {"name": OBJECTIVE[kind]},
        "tokenizer": {"path": str(world["tokenizer"])},
        "data": {"sources": [{"name": "tiny", "prepared": str(world["data"])}], "seq_len": 32,
                 "micro_batch_size": 4},
        "optim": {"warmup_steps": 2},
        "trainer": {"max_steps": 10, "val_check_interval": 5, "limit_val_batches": 2, "log_every_n_steps": 1,
                    "progress_bar": False},
        "logger": {"wandb": {"enabled": False}, "csv": True},
        "checkpoint": {"every_n_steps": 5, "save_top_k": 1},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    path = directory / f"tiny-{kind}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretrain.cli", *args]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment of a CLI subprocess: 1 thread per process (deterministic, no oversubscription), no network."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", **extra}


def run_cli(*args: str, cwd: Path = REPO_ROOT, timeout: float = 600, check: bool = True,
            **env: str) -> subprocess.CompletedProcess:
    """Run ``pretrain *args``; on an unexpected status the failure shows the output."""
    proc = subprocess.run(cli_command(*args), cwd=cwd, env=cli_env(**env), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Rows of every ``logs/version_*/metrics.csv`` of a run (one version per launch), in launch order."""
    rows = []
    versions = sorted((run_dir / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        with open(version / "metrics.csv", newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


def metric_by_step(rows: list[dict[str, str]], name: str) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name) not in (None, "")}
