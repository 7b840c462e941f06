"""Writing files of the data stages safely: atomic replacement, one-writer locks, and storage errors that name
the path (a full disk raises ``OSError`` without a file name when it happens inside a write)."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

# a full disk, a quota, a file-size limit or a location the user may not write
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, fsync, then ``os.replace``: a reader sees the old
    file or the complete new one, never a truncated one (a failed write leaves the old file as it was)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # the umask's permissions, as a plain write would have
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise naming(err, path) from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def naming(err: OSError, path: str | os.PathLike) -> OSError:
    """``err`` with ``path`` as its file name when it has none (a storage error raised inside a write)."""
    if err.filename is not None or err.errno not in STORAGE_ERRNOS:
        return err
    return type(err)(
        err.errno, f"{os.strerror(err.errno)} while writing", str(path)
    )


@contextlib.contextmanager
def exclusive(directory: Path, what: str) -> Iterator[None]:
    """Hold ``.<directory name>.lock`` next to ``directory`` while writing it; a second writer gets one line."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory.with_name(f".{directory.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ValueError(
            f"another {what} is writing {directory} right now (lock {lock.lock_file} is held); wait for it to "
            f"finish, or write to another directory"
        ) from None
    try:
        yield
    finally:
        Path(lock.lock_file).unlink(missing_ok=True)  # leave no file behind (a waiting writer fails anyway)
        lock.release()
