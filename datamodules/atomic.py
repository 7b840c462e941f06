"""Atomic replacement of a finished file or directory (prepared data, checkpoints), and the errors that mean the
storage refused a write (full, read-only, no permission)."""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
from pathlib import Path

# a full disk or a path the user may not write: reported in one line naming the fix, not as a traceback
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def _rename_exchange(src: Path, dst: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_exchange) == 0


def replace_path(src: Path, dst: Path) -> None:
    """Move the complete ``src`` (file or directory) to ``dst``, replacing whatever is there in one atomic step
    (an exchange of the two names, then the old one is deleted): a reader never sees a partial result. Without
    an atomic exchange, two renames via ``.<name>.old-<random>``, the old copy put back if the second fails."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and _rename_exchange(src, dst):
        old = src
    elif dst.exists():
        old = dst.with_name(f".{dst.name}.old-{secrets.token_hex(4)}")
        os.replace(dst, old)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(old, dst)
            raise
    else:
        os.replace(src, dst)
        return
    shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
