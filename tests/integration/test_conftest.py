"""The shared-data and direct-I/O fixtures: what they need missing skips on a developer's machine and fails in CI."""

from __future__ import annotations

import os
import subprocess
import sys

from training_utils import REPO_ROOT

PROBE = "def test_probe(shared_data):\n    assert shared_data.is_dir()\n"


DIRECT_PROBE = """import errno
import os

_open = os.open


def _refusing_direct_io(path, flags, *args):  # as a file system without O_DIRECT answers
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, "Invalid argument")
    return _open(path, flags, *args)


os.open = _refusing_direct_io


def test_probe(direct_io):
    pass
"""


def _run_probe(tmp_path, ci: str | None, probe: str = PROBE, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(probe)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {
        "PRETRAIN_SHARED_DATA": str(tmp_path / "none")
    }
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_missing_shared_data_fails_in_ci_and_skips_elsewhere(tmp_path):
    ci = _run_probe(tmp_path, "true")
    assert ci.returncode == 1 and "in CI the reference tests on real data must run" in ci.stdout, ci.stdout
    local = _run_probe(tmp_path, None)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout


def test_a_temporary_directory_without_o_direct_fails_in_ci_and_skips_elsewhere(tmp_path):
    ci = _run_probe(tmp_path, "true", DIRECT_PROBE)
    assert ci.returncode == 1 and "in CI the direct-I/O tests must run" in ci.stdout, ci.stdout
    local = _run_probe(tmp_path, None, DIRECT_PROBE)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
