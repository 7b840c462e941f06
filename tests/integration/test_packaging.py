"""The wheel works on its own: built from the tree, installed into a fresh virtual environment, it runs a shipped
recipe by name from an unrelated directory (configs, recipes and the shipped corpus are package data of the one
namespace ``pretrain``), next to another project's top-level ``configs`` and ``recipes`` packages."""

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
    for name in (
        "pretrain",
        "objectives",
        "datamodules",
        "configs",
        "recipes",
    ):  # pretrain/objectives: a link
        shutil.copytree(REPO_ROOT / name, source / name, ignore=skip, symlinks=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    wheels = [source, other_project(tmp_path / "other")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            dist,
            *wheels,
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("pretrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "pretrain/configs/model/gpt-tiny.yaml",
        "pretrain/recipes/gpt-tiny.yaml",
        "pretrain/recipes/data/tinyshakespeare.txt",
    } <= names
    assert {n.split("/")[0] for n in names} == {"pretrain", "pretrain-0.1.0.dist-info"}
    assert {"pretrain/objectives/clm.py", "pretrain/datamodules/prepare.py"} <= names

    venv = tmp_path / "venv"
    python, script = venv_with_these_packages(venv), venv / "bin" / "pretrain"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", *dist.glob("*.whl")],
        check=True,
        capture_output=True,
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WANDB_MODE": "offline"}
    where = subprocess.run(
        [
            python,
            "-c",
            (
                "import configs, pretrain.config as c, pretrain.objectives as o; "
                "print(c.__file__, c.CONFIG_DIR, c.RECIPE_DIR, o.__file__, configs.WHO)"
            ),
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.count(str(venv)) == 4 and where.split()[-1] == "other", (
        f"the wheel is not what runs: {where}"
    )
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


def other_project(root):
    """Another project's top-level ``configs``, ``recipes``, ``objectives`` and ``datamodules`` packages: a
    ``gpt-tiny`` piece and recipe that would fail to compose if we read them, and modules that fail if imported."""
    for package in ("configs", "recipes"):
        (root / package / "model").mkdir(parents=True)
        (root / package / "__init__.py").write_text('WHO = "other"\n')
    for package in ("objectives", "datamodules"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(f'raise ImportError("another project\'s {package}")\n')
    (root / "configs" / "model" / "gpt-tiny.yaml").write_text("d_model: not-a-number\n")
    (root / "recipes" / "gpt-tiny.yaml").write_text("defaults: [model/none]\n")
    (root / "pyproject.toml").write_text(
        '[project]\nname = "other-configs"\nversion = "1.0"\n'
        '[tool.setuptools]\npackages = ["configs", "recipes", "objectives", "datamodules"]\n'
        '[tool.setuptools.package-data]\nconfigs = ["**/*.yaml"]\nrecipes = ["*.yaml"]\n'
    )
    return root
