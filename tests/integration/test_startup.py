"""Bad input is reported before any heavy import: a typo in a recipe override and ``--help`` of a verb need
neither torch nor Lightning; a run imports no library it does not use (a fresh interpreter shows what was
imported)."""

from __future__ import annotations

import subprocess
import sys

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


def test_a_config_typo_is_reported_without_importing_torch():
    proc = probe("fit", "recipes/gpt-tiny.yaml", "trainer.max_step=1")
    assert "status 2 heavy []" in proc.stdout, proc.stdout + proc.stderr
    assert "did you mean max_steps" in proc.stderr


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
