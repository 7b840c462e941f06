"""The wheel works on its own: built from the tree, installed into a fresh virtual environment, it runs a shipped
recipe by name from an unrelated directory (configs, recipes and the shipped corpus are package data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from training_utils import REPO_ROOT
from venvs import venv_with_these_packages

QUICK = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.progress_bar=false",
    "logger.wandb.enabled=false",
    "data.micro_batch_size=2",
]


@pytest.mark.slow
def test_wheel_installs_and_runs_a_shipped_recipe_from_another_directory(tmp_path):
    source, dist = tmp_path / "source", tmp_path / "dist"  # built from a copy: the tree gets no build/ folder
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "runs")
    for name in ("pretrain", "objectives", "datamodules", "configs", "recipes"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("pretrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "configs/model/gpt-tiny.yaml",
        "recipes/gpt-tiny.yaml",
        "recipes/data/tinyshakespeare.txt",
    } <= names

    venv = tmp_path / "venv"
    python, script = venv_with_these_packages(venv), venv / "bin" / "pretrain"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel],
        check=True,
        capture_output=True,
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WANDB_MODE": "offline"}
    where = subprocess.run(
        [python, "-c", "import pretrain, configs; print(pretrain.__file__, configs.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.count(str(venv)) == 2, f"the wheel is not what runs: {where}"
    for verb in ("tokenizer", "prepare", "fit"):
        done = subprocess.run(
            [script, verb, "gpt-tiny", *QUICK],
            check=False,
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"pretrain {verb} gpt-tiny failed:\n{done.stderr[-2000:]}"
    assert (elsewhere / "runs" / "gpt-tiny" / "checkpoints" / "last.ckpt").is_file()
