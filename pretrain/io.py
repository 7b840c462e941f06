"""Writing files safely (prepared data and checkpoints): atomic replacement of files and directories, one-writer
locks, and storage errors that name the path (a full disk raises ``OSError`` without a file name when it happens
inside a write)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from pretrain.errors import InputError

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


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` (e.g. ``torch.save``, ``savefig``) to a temporary file next to ``path``, fsync, then
    ``os.replace``: a reader sees the old file or the complete new one (a failed write leaves the old one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        try:
            write(tmp)
        except Exception as err:  # a library's writer (torch.save) reports a full disk in its own words
            if isinstance(err, OSError) or (full := refused_write(err, tmp)) is None:
                raise
            raise OSError(full, f"{os.strerror(full)} while writing", str(path)) from err
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise naming(err, path) from err
    finally:
        tmp.unlink(missing_ok=True)
    return path


def refused_write(err: Exception, path: Path) -> int | None:
    """The storage errno behind a library writer's own exception ``err`` while writing ``path``: the one its
    message quotes (Rust's "(os error 27)", safetensors), else what ``out_of_space`` finds there, else None."""
    import re

    quoted = re.search(r"\(os error (\d+)\)", str(err))
    if quoted and int(quoted.group(1)) in STORAGE_ERRNOS:
        return int(quoted.group(1))
    return out_of_space(path)


def out_of_space(path: Path) -> int | None:
    """``errno.EFBIG`` when file ``path`` (or the largest file in directory ``path``) reached this process's
    file-size limit, ``errno.ENOSPC`` when its disk has (next to) no space left, else None: what a failed write
    there most likely met."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        size = max((p.stat().st_size for p in files), default=0)
        disk = os.statvfs(path if path.is_dir() else path.parent)
    except OSError:
        return None
    if limit != resource.RLIM_INFINITY and size >= limit - (1 << 16):
        return errno.EFBIG
    return errno.ENOSPC if disk.f_bavail * disk.f_frsize < (1 << 20) else None


STAGING_MARK = ".partial-"  # in the name of a multi-file output being written (``staged_directory``)


@contextlib.contextmanager
def staged_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """A fresh directory next to ``directory`` (``.<name>.partial-<random>``) to write a multi-file output into
    (an export); on success its files take their place in ``directory``: the whole directory renamed in one step
    when ``directory`` is missing or empty, else file by file, each replacing its old version. On failure it is
    removed: ``directory`` never holds some files of the new output and none of the others."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f".{directory.name}{STAGING_MARK}{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        try:
            yield staging
        except Exception as err:  # a library's writer (safetensors) reports a full disk in its own words
            if isinstance(err, OSError) or (full := refused_write(err, staging)) is None:
                raise
            raise OSError(full, f"{os.strerror(full)} while writing", str(directory)) from err
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        if not directory.exists():
            os.replace(staging, directory)
            return
        for item in sorted(staging.iterdir()):
            if (directory / item.name).is_dir() and item.is_dir():
                shutil.rmtree(directory / item.name)
            os.replace(item, directory / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stale_staging(directory: str | os.PathLike) -> list[Path]:
    """Remove the staging directories (``staged_directory``) that writers of ``directory`` killed mid-write left
    next to it (``.<name>.partial-*``: SIGKILL runs no clean-up); each is a whole output's size, and nothing
    removed them. Call it only under ``directory``'s lock (``run_lock``): then no live writer owns one.
    Returns those removed."""
    directory = Path(directory)
    stale = sorted(directory.parent.glob(f".{directory.name}{STAGING_MARK}*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def umask() -> int:
    """The process's umask (``/proc/self/status`` on Linux; elsewhere set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def permissions_as_umask(directory: str | os.PathLike) -> None:
    """Give the files in ``directory`` the permissions a plain ``open`` gives under the umask: libraries that
    write through a private temporary file (``mkstemp``: 0600, e.g. transformers' weights) leave them readable
    only by their owner."""
    mode = 0o666 & ~umask()
    for path in Path(directory).iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def naming(err: OSError, path: str | os.PathLike) -> OSError:
    """``err`` with ``path`` as its file name when it has none (a storage error raised inside a write)."""
    if err.filename is not None or err.errno not in STORAGE_ERRNOS:
        return err
    return type(err)(err.errno, f"{os.strerror(err.errno)} while writing", str(path))


def lock_path(directory: str | os.PathLike) -> Path:
    """The lock of ``directory``: ``.<name>.lock`` next to it (a prepared directory is replaced whole)."""
    directory = Path(directory).resolve()  # one lock however the directory is named (".", "runs/x/")
    return directory.with_name(f".{directory.name}.lock")


@contextlib.contextmanager
def exclusive(directory: str | os.PathLike, what: str) -> Iterator[None]:
    """One writer of ``directory`` at a time: an exclusive ``flock`` on :func:`lock_path`, which records the
    holder (pid, host, ``what``, since when). A second writer gets one line naming the holder. The kernel drops
    the lock when its process ends however it ends (SIGKILL, a node's requeue), so a restarted run takes the lock
    of its dead predecessor over; only processes the holder forked (data-loader workers) keep it a little longer.
    Where the filesystem has no locks, a warning says so and the writer goes on."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _locked(path, directory, what)
    try:
        if fd >= 0:
            record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a writer that opened it before retries (``_locked``)
        if fd >= 0:
            os.close(fd)  # and with it the lock


def _locked(path: Path, directory: str | os.PathLike, what: str) -> int:
    """A descriptor of ``path`` holding its exclusive ``flock`` (-1 where the filesystem has none). A file its
    holder removed between our ``open`` and our lock is no lock: open the current one again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise InputError(
                f"another {what} ({holder}) is writing {directory} right now (lock {path}); wait for it to "
                "finish, or write to another directory"
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise naming(err, path) from err
            warnings.warn(
                f"{path}: the filesystem has no file locks; a second writer of {directory} is not detected",
                stacklevel=4,
            )
            return -1
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


# rank variables of the launchers (torchrun, srun, MPI, Lightning's own subprocess launcher and multi-node runs)
RANK_VARIABLES = (
    "RANK",
    "SLURM_PROCID",
    "PMI_RANK",
    "OMPI_COMM_WORLD_RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
)


# set by a process that holds a run's lock for the child it starts on that run (``pretrain ladder``'s cells)
HELD_BY_PARENT = "PRETRAIN_RUN_LOCK_HELD"


def run_lock(directory: str | os.PathLike, what: str) -> contextlib.AbstractContextManager:
    """:func:`exclusive` in the first process of a launch; its other ranks (whatever started them) write under
    that lock, so one launch holds it once, and a restarted launch takes it over from its ended predecessor. A
    process whose parent holds it for it (``HELD_BY_PARENT`` names its lock file) writes under the parent's."""
    if any(os.environ.get(name, "0") not in ("", "0") for name in RANK_VARIABLES):
        return contextlib.nullcontext()
    if os.environ.get(HELD_BY_PARENT) == str(lock_path(directory)):
        return contextlib.nullcontext()
    return exclusive(directory, what)


def _holder(fd: int) -> str:
    """Who holds the lock open as ``fd``, from what it wrote there."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host = int(record["pid"]), str(record["host"])
    except (ValueError, KeyError, TypeError, OSError):
        return "a process that has not said which"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("since", 0))))
    where = f"pid {pid} on host {host}, {record.get('what', '?')} since {since}"
    if host == socket.gethostname() and not _alive(pid):
        where += "; that process has ended, a process it started still holds the lock"
    return where


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rename_exchange(src: Path, dst: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_exchange) == 0


def exchanges_atomically(directory: Path) -> bool:
    """Whether the file system of ``directory`` (created if missing) swaps two names in one atomic step
    (``renameat2(RENAME_EXCHANGE)``: local Linux file systems; not NFS, most FUSE mounts, macOS)."""
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    a, b = directory / f".exchange-probe-{token}-a", directory / f".exchange-probe-{token}-b"
    try:
        a.mkdir()
        b.mkdir()
        return _rename_exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


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
