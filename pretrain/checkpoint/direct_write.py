"""Checkpoint files written around the page cache, at a paced rate (``checkpoint.async_save``'s background write).

A buffered write copies every byte into page-cache pages first; a checkpoint is a new file at every save (the
previous one deleted), so those pages are fresh memory the kernel must supply -- on a virtual machine, with host
work charged to the guest's CPUs -- and the training threads pay for it whatever the writer's priority. With
``O_DIRECT`` the device reads the bytes from this process's buffer: 1.5 GiB into a new file kept the machine's
CPUs busy 0.24 s instead of 1.77 (``python benchmarks/bench_direct_write.py``, 2-core VM; while the training keeps
both cores busy, the host's I/O work for the device still lands on them, which the pacing spreads out).

``DirectStream`` is the file object DCP's ``FileSystemWriter`` writes a ``.distcp`` file or ``.metadata`` into (its
``fs`` replaced by a ``DirectFileSystem``): the bytes are exactly DCP's (``torch.save`` archives at the offsets
``tell`` reports). They are gathered in an aligned buffer of ``CHUNK`` bytes, each full buffer written with
``pwrite`` at an aligned offset; ``close`` writes the last one padded to ``ALIGN``, truncates the file to its
length and ``fsync``s it (the data is on the device, its size and extents not yet). Where the file system
refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network file systems: ``EINVAL`` at open or at a write) the
same chunks go through the page cache.

Pacing: after each chunk the writer sleeps ``(1 / share - 1)`` times that chunk's write time, so the device is
busy with this write for about ``share`` of the wall clock and the write takes about ``1 / share`` times as long
as it would alone. The training's share of the machine is what is left (the ``checkpoint.async_write_share``).

Tested against torch 2.13's ``torch.distributed.checkpoint.filesystem`` (``FileSystem.create_stream`` is how
``FileSystemWriter`` opens every file it writes; its ``fs`` attribute is set in its constructor).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

ALIGN = 4096  # offsets, lengths and the buffer's address: a multiple of every device's logical block size
CHUNK = 8 << 20  # bytes per write


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DirectStream:
    """A write-only file object over ``path`` (created or truncated) written with ``O_DIRECT`` where the file
    system allows it, paced to ``share`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, share: float = 1.0):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.path, self.share = Path(path), share
        self.direct = hasattr(os, "O_DIRECT")
        self.paused = 0.0  # seconds slept by the pacing
        self._fd = self._open(os.O_CREAT | os.O_TRUNC)
        self._buffer = mmap.mmap(-1, CHUNK)  # page-aligned
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)
        self._fill = 0  # bytes in the buffer
        self._offset = 0  # file offset of the buffer's first byte (a multiple of CHUNK)
        self.closed = False

    def _open(self, flags: int) -> int:
        flags |= os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        if self.direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o666)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(self.path, flags, 0o666)

    # ------------------------------------------------------------------------------------------ file object
    def write(self, data: bytes | bytearray | memoryview) -> int:
        source = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        done, size = 0, len(source)
        while done < size:
            take = min(CHUNK - self._fill, size - done)
            self._array[self._fill : self._fill + take] = source[done : done + take]  # releases the GIL
            self._fill += take
            done += take
            if self._fill == CHUNK:
                self._write_buffer()
                self._offset += CHUNK
                self._fill = 0
        return size

    def tell(self) -> int:
        return self._offset + self._fill

    def flush(self) -> None:
        """Nothing: a chunk is written once full, the rest at ``close``."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Write what is buffered, truncate the file to its length, ``fsync`` it and close it."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._fill:
                self._write_buffer()
            os.ftruncate(self._fd, self._offset + self._fill)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            del self._array
            self._buffer.close()

    # ------------------------------------------------------------------------------------------ writes
    def _write_buffer(self) -> None:
        """The buffer's first ``_fill`` bytes at ``_offset``, padded with zeros to ``ALIGN``; then the pacing."""
        length = round_up(self._fill, ALIGN)
        self._array[self._fill : length] = 0
        view = memoryview(self._buffer)[:length]
        start = time.monotonic()
        written = 0
        try:
            while written < length:
                rest = view[written:]
                try:
                    written += os.pwrite(self._fd, rest, self._offset + written)
                except OSError as err:
                    if not (self.direct and err.errno == errno.EINVAL):
                        raise
                    os.close(self._fd)  # O_DIRECT opened but refused at the write: through the page cache
                    self.direct = False
                    self._fd = self._open(0)
                finally:
                    rest.release()  # (an error's traceback may hold it: the buffer must close all the same)
        finally:
            view.release()
        if self.share < 1:
            pause = (time.monotonic() - start) * (1 / self.share - 1)
            self.paused += pause
            time.sleep(pause)


class DirectFileSystem(FileSystem):
    """DCP's local file system whose files are written by ``DirectStream`` (read as before)."""

    def __init__(self, share: float = 1.0):
        super().__init__()
        self.share = share

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as read:
                yield read
            return
        stream = DirectStream(path, self.share)
        try:
            yield stream
        finally:
            stream.close()


def direct_writer(path: str | os.PathLike, share: float = 1.0) -> FileSystemWriter:
    """A DCP ``FileSystemWriter`` of directory ``path`` whose files are ``DirectStream``s (each ``fsync``ed when
    closed: DCP's own ``sync_files`` would run before the last chunk is written)."""
    writer = FileSystemWriter(path, sync_files=False)
    writer.fs = DirectFileSystem(share)
    return writer
