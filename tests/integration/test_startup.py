"""Bad input is reported before any heavy import: a typo in a recipe override and ``--help`` of a verb need
neither torch nor Lightning; a run imports no library it does not use (a fresh interpreter shows what was
imported)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from training_utils import REPO_ROOT, cli_env, tiny_recipe

PROBE = """
import os, sys
from pretrain.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:  # --help
    status = stop.code
heavy = sorted(m for m in os.environ["PROBE_MODULES"].split(",") if m in sys.modules)
print("status", status, "heavy", heavy)
"""

# what a run needs (torch, lightning), and what it must not import: transformers, scipy.signal and matplotlib
# (torchmetrics' integrations, which Lightning's import of torchmetrics pulls in when installed) and the
# inductor (torch.compile)
HEAVY = ("torch", "lightning", "transformers", "scipy", "matplotlib", "torch._inductor.compile_fx")


def probe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=REPO_ROOT,
        env=cli_env(PROBE_MODULES=",".join(HEAVY)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "verb, recipe",
    [
        ("fit", "gpt-tiny"),
        ("validate", "gpt-tiny"),
        ("tokenizer", "gpt-tiny"),
        ("prepare", "gpt-tiny"),
        ("finetune", "finetune-sst2-minilm"),
        ("evaluate", "eval-core"),
        ("baseline", "lstm-lm-tiny"),
    ],
)
def test_a_config_typo_is_reported_without_importing_torch(verb, recipe):
    """Every recipe verb checks its options the same way: one line naming the key, before torch or Lightning is
    imported (so within a second and with no library notice before it; finetune took ~10 s with notices)."""
    proc = probe(verb, f"recipes/{recipe}.yaml", "trainer.max_stepz=1" if verb != "evaluate" else "limt=1")
    assert "status 2 heavy []" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "did you mean" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "argv, message, heavy",
    [  # objective.options are checked without torch (before: fit imported it for them, 7.6 s to the error)
        (
            ["fit", "gpt-tiny", "tokenizer.path=/nonexistent/t.json"],
            "train one with `pretrain tokenizer`",
            "[]",
        ),
        (
            ["fit", "gpt-tiny", "objective.options.bogus=1"],
            "objective 'clm': unknown options ['bogus']",
            "[]",
        ),
        (
            ["fit", "bert-tiny", "objective.options.mlm_probability=abc"],
            "objective.options.mlm_probability: expected float",
            "[]",
        ),
        (
            ["evaluate", "/nonexistent.ckpt", "--tasks", "copa"],
            "checkpoint /nonexistent.ckpt does not exist",
            "[]",
        ),
        (["evaluate", "/nonexistent.ckpt", "--tasks", "copa,copx"], "unknown task 'copx'", "[]"),
        (["generate", "/nonexistent.ckpt", "--temperature", "-1"], "--temperature must be > 0", "[]"),
        (
            ["finetune", "recipes/finetune-sst2-gpt-tiny.yaml", "init.checkpoint=/nonexistent.ckpt"],
            "init.checkpoint /nonexistent.ckpt not found",
            "[]",
        ),
        (
            ["validate", "gpt-tiny", "--ckpt", "/nonexistent.ckpt"],
            "/nonexistent.ckpt (--ckpt) does not exist",
            "[]",
        ),
        (
            ["export", "/nonexistent.ckpt", "/tmp/x"],
            "/nonexistent.ckpt (export CHECKPOINT) does not exist",
            "[]",
        ),
    ],
)
def test_a_missing_input_file_is_reported_before_lightning_is_imported(argv, message, heavy):
    """A run's first mistakes (no tokenizer trained, a mistyped checkpoint, task or flag): one line before
    Lightning, transformers or a model is loaded (before: after them, 10-35 s at load 15-22; validate --ckpt was
    named resume=)."""
    proc = probe(*argv)
    assert f"status 2 heavy {heavy}" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_help_of_a_verb_imports_neither_torch_nor_lightning():
    proc = probe("fit", "--help")
    assert "--print-config" in proc.stdout and "status 0 heavy []" in proc.stdout, proc.stdout + proc.stderr


def test_a_fit_imports_neither_transformers_scipy_matplotlib_nor_the_inductor(tiny_world, tmp_path):
    """One step and a validation: torch and Lightning only (the CSV log, and with it the curves' plot, is off:
    matplotlib is imported to draw them). Fails if torchmetrics is imported with its integrations or
    flex_attention is compiled at import."""
    recipe = tiny_recipe(
        tmp_path,
        tiny_world,
        trainer={"max_steps": 1, "val_check_interval": 1, "limit_val_batches": 1},
        logger={"wandb": {"enabled": False}, "csv": False},
    )
    proc = probe("fit", str(recipe))
    assert "status 0 heavy ['lightning', 'torch']" in proc.stdout, proc.stdout + proc.stderr
