"""Virtual environments for tests that install the built wheel: they must see the packages of the interpreter
running the tests, also when that interpreter is itself a virtualenv (``make test`` in a user's venv)."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path


def venv_with_these_packages(path: Path, *, pip: bool = True) -> Path:
    """A virtual environment at ``path`` whose interpreter sees this interpreter's installed packages; its python.

    ``venv --system-site-packages`` alone gives the *base* interpreter's packages: from inside a virtualenv those
    are not the ones installed there (torch, lightning ...). A ``.pth`` file adds this interpreter's site
    directories after the new environment's own, so what is installed into it still comes first."""
    args = [sys.executable, "-m", "venv", "--system-site-packages", *([] if pip else ["--without-pip"]), path]
    subprocess.run(args, check=True, capture_output=True)
    python = Path(path) / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [*site.getsitepackages(), site.getusersitepackages()]
    lines = [f"import site; site.addsitedir({d!r})\n" for d in ours if Path(d).is_dir()]
    (Path(purelib) / "_outer_site_packages.pth").write_text("".join(lines))
    return python
