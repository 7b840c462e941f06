"""Bad input is reported before any heavy import: a typo in a recipe override and ``--help`` of a verb need
neither torch nor Lightning (a fresh interpreter shows what was imported)."""

from __future__ import annotations

import subprocess
import sys

from training_utils import REPO_ROOT, cli_env

PROBE = """
import sys
from pretrain.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:  # --help
    status = stop.code
heavy = sorted(m for m in ("torch", "lightning", "transformers") if m in sys.modules)
print("status", status, "heavy", heavy)
"""


def probe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=REPO_ROOT,
        env=cli_env(),
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
