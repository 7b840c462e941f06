"""Checkpoint bytes one tensor at a time (``pretrain convert``), through formats torch keeps private.

``save_filled``: ``torch.save`` with the tensors' data supplied one at a time, as torch writes them.

Uses torch's private ``torch.serialization._open_zipfile_writer`` and ``_save`` (torch 2.13; the public behaviour
it stands in for: ``torch.save(obj, f)``, byte for byte): ``_save`` pickles ``obj`` (each storage becomes a
persistent id: storage type, key, location, size) and then writes each storage as the record ``data/<key>``, in
the order it met them. Here ``obj`` holds placeholder tensors of the right dtype and size whose storages are
never read (unread private mappings of a sparse file: no memory), and each record's bytes come from
``fill(placeholder storage)``, loaded when that record is written and released after it: the file is what
``torch.save`` of the real tensors writes, and at most one of them is in memory.

``read_chunks_into``: a tensor of a torch.distributed.checkpoint directory read straight into its destination.
DCP's reader loads each stored chunk as a tensor of its own (a ``torch.save`` archive at ``_StorageInfo``'s
offset and length in a ``.distcp`` file) and copies it into place. Where every chunk is a contiguous block of the
destination (dim-0 shards: FSDP2's) and stored untransformed, the chunk archive's one data record (uncompressed,
as ``torch.save`` writes it; found with ``zipfile``) is read with ``readinto`` into that block: the tensor
is the only memory the read takes. Tested against DCP's own reader.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch

from pretrain.errors import InputError


class _Records:
    """The zip writer ``_save`` writes through, with storage records filled by ``fill``."""

    def __init__(self, writer: Any, fill: Callable[[torch.UntypedStorage], torch.Tensor | None]):
        self._writer, self._fill = writer, fill

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        real = self._fill(data) if isinstance(data, torch.UntypedStorage) else None
        if real is None:
            self._writer.write_record(name, data, nbytes)
            return
        storage = real.untyped_storage()
        assert storage.nbytes() == nbytes, (name, storage.nbytes(), nbytes)
        self._writer.write_record(name, storage, nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def save_filled(obj: Any, f: IO[bytes], fill: Callable[[torch.UntypedStorage], torch.Tensor | None]) -> None:
    """``torch.save(obj, f)`` where each storage's bytes are ``fill(storage)`` (a tensor with the same bytes, or
    None: the storage's own)."""
    from torch.serialization import _open_zipfile_writer, _save

    with _open_zipfile_writer(f) as writer:
        _save(obj, _Records(writer, fill), pickle, 2, False)


@contextmanager
def placeholders() -> Iterator[Callable[[torch.Size, torch.dtype], torch.Tensor]]:
    """A factory of placeholder tensors (CPU, contiguous, the given size and dtype) whose memory is never
    allocated: private mappings of one sparse file, valid inside the context."""
    with tempfile.TemporaryDirectory(prefix="pretrain-placeholders-") as tmp:
        path = os.path.join(tmp, "sparse")
        size = [0]

        def make(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            numel = int(torch.Size(shape).numel())
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if nbytes > size[0]:
                with open(path, "ab") as f:
                    f.truncate(nbytes)
                size[0] = nbytes
            return torch.from_file(path, shared=False, size=numel, dtype=dtype).view(shape)

        yield make


class _Window:
    """A read-only file view of ``length`` bytes from ``start`` (what ``zipfile`` reads an archive from)."""

    def __init__(self, f: IO[bytes], start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


def _data_offset(f: IO[bytes], start: int, length: int, nbytes: int) -> int | None:
    """The file offset of the one storage record of the ``torch.save`` archive at ``[start, start + length)``,
    holding ``nbytes`` uncompressed bytes; None when the archive is not that."""
    with zipfile.ZipFile(_Window(f, start, length)) as archive:
        records = [i for i in archive.infolist() if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        if (
            len(records) != 1
            or records[0].compress_type != zipfile.ZIP_STORED
            or records[0].file_size != nbytes
        ):
            return None
        header = records[0].header_offset
    f.seek(start + header)
    local = f.read(30)
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return start + header + 30 + name_length + extra_length


def read_chunks_into(directory: str | os.PathLike, metadata: Any, key: str, out: torch.Tensor) -> bool:
    """Read DCP tensor ``key`` of ``directory`` (``metadata``: its ``Metadata``) into ``out`` (contiguous, its full
    size and dtype), each chunk straight into place; False, with nothing read, when a chunk is not a contiguous
    block of it or not stored as a plain ``torch.save`` archive."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    item = metadata.state_dict_metadata[key]
    size = list(item.size)
    plans = []
    for index, chunk in enumerate(item.chunks):
        if list(chunk.offsets[1:]) != [0] * (len(size) - 1) or list(chunk.sizes[1:]) != size[1:]:
            return False
        info = metadata.storage_data[MetadataIndex(key, torch.Size(chunk.offsets), index)]
        if getattr(info, "transform_descriptors", None):
            return False
        plans.append((chunk, info))
    row = math.prod(size[1:]) if len(size) > 1 else 1
    flat = out.view(-1).view(torch.uint8).view(out.numel(), out.element_size()) if out.numel() else None
    for chunk, info in plans:
        count = (chunk.sizes[0] if size else 1) * row
        if count == 0:
            continue
        first = (chunk.offsets[0] if size else 0) * row
        assert flat is not None  # some elements to read
        block = flat[first : first + count].view(-1).numpy()
        with open(os.path.join(directory, info.relative_path), "rb") as f:
            offset = _data_offset(f, info.offset, info.length, block.nbytes)
            if offset is None:
                return False
            f.seek(offset)
            if f.readinto(block.data) != block.nbytes:
                raise InputError(f"{directory}: the data of {key} is truncated")
    return True
