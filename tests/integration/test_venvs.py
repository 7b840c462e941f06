"""``make test`` inside a user's virtualenv: the wheel test's environment sees that virtualenv's packages."""

from __future__ import annotations

import subprocess
from pathlib import Path

from venvs import venv_with_these_packages

TESTS = Path(__file__).resolve().parents[1]


def test_a_venv_made_from_inside_a_virtualenv_sees_its_packages(tmp_path):
    user_venv = venv_with_these_packages(tmp_path / "user", pip=False)  # the user's virtualenv ...
    purelib = subprocess.run(
        [user_venv, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "only_in_the_users_venv.py").write_text("")  # ... with a package only it has
    script = (
        f"import subprocess, sys; sys.path.insert(0, {str(TESTS)!r}); from venvs import venv_with_these_packages; "
        f"python = venv_with_these_packages({str(tmp_path / 'wheel-test')!r}, pip=False); "
        "subprocess.run([python, '-c', 'import only_in_the_users_venv'], check=True)"
    )
    done = subprocess.run([user_venv, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
