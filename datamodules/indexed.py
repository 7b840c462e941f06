"""Token shards in Megatron-LM's memory-mapped indexed-dataset layout (``prefix.bin`` + ``prefix.idx``).

``prefix.bin`` is the raw token ids of every document, concatenated (each document ends with EOS).
``prefix.idx`` (all integers little-endian)::

    b"MMIDIDX\\x00\\x00"            9-byte magic
    version                         uint64, always 1
    dtype code                      uint8   (Megatron's table: 4 = int32, 8 = uint16, ...)
    sequence count  N               uint64
    document count  N + 1           uint64
    sequence lengths                int32[N]    tokens per document
    sequence pointers               int64[N]    byte offset of each document in prefix.bin
    document indices                int64[N+1]  0, 1, ..., N (one sequence per document)

This is what ``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads. Opening is O(1): both
files are memory-mapped and nothing is scanned. Token ids use uint16 when the vocabulary fits in 16 bits,
else int32 (Megatron's table has no uint32; ids stay far below 2**31).
"""

from __future__ import annotations

import os
import struct
from functools import cached_property
from pathlib import Path

import numpy as np

from pretrain.errors import InputError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, type[np.integer]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_CHUNK = 1 << 16  # elements per streamed block when finalising an index (bounds its memory)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest Megatron-readable dtype that holds ids ``0 .. vocab_size-1``: uint16, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedWriter:
    """Appends documents to ``prefix.bin`` as they come; ``finalize()`` writes ``prefix.idx``.

    Memory stays O(block): document lengths are spilled to a side file and the index is streamed,
    so a corpus of any size is written with bounded RSS. Use as a context manager; on error the
    partial files are removed.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type | str):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(
                f"dtype {self.dtype} has no Megatron code; use one of {sorted(map(str, _CODE_OF))}"
            )
        self.bin_path, self.idx_path = _paths(prefix)
        self._len_path = Path(str(prefix) + ".len.tmp")
        self._bin = open(self.bin_path, "wb")  # noqa: SIM115 (the writer's own: closed by finalize or abort)
        self._lens = open(self._len_path, "wb")  # noqa: SIM115
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat array ``tokens`` (sum(lengths),) and their ``lengths`` (D,)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if len(lengths) and (lengths.min() < 0 or lengths.max() >= 1 << 31):
            raise ValueError("document lengths must lie in [0, 2**31)")
        tokens = np.asarray(tokens)
        if len(tokens) and tokens.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            if tokens.min() < info.min or tokens.max() > info.max:
                raise ValueError(f"token ids in [{tokens.min()}, {tokens.max()}] do not fit {self.dtype}")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self._lens.write(lengths.astype(np.int32).data)
        self.num_documents += len(lengths)
        self.num_tokens += len(tokens)

    def finalize(self) -> None:
        """Write ``prefix.idx`` by streaming the spilled lengths (pointers = running byte offsets)."""
        self._bin.close()
        self._lens.close()
        n = self.num_documents
        item = self.dtype.itemsize
        with open(self.idx_path, "wb") as idx:
            idx.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF[self.dtype], n, n + 1))
            with open(self._len_path, "rb") as f:  # sequence lengths, int32[N]
                while block := f.read(4 * _CHUNK):
                    idx.write(block)
            start = 0  # sequence pointers, int64[N]: exclusive prefix sum of lengths * itemsize
            with open(self._len_path, "rb") as f:  # read, not memory-mapped: mapped pages would count as RSS
                while block := f.read(4 * _CHUNK):
                    sizes = np.frombuffer(block, dtype=np.int32).astype(np.int64) * item
                    ends = np.cumsum(sizes) + start
                    idx.write((ends - sizes).tobytes())
                    start = int(ends[-1])
            idx.writelines(  # document indices, int64[N+1]
                np.arange(lo, min(lo + _CHUNK, n + 1), dtype=np.int64).tobytes()
                for lo in range(0, n + 1, _CHUNK)
            )
        self._len_path.unlink()

    def abort(self) -> None:
        self._bin.close()
        self._lens.close()
        for p in (self.bin_path, self.idx_path, self._len_path):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:  # noqa: PYI034 (typing.Self is 3.11+)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of ``prefix.bin/.idx``; opening memory-maps both files and costs O(1).

    ``tokens``: 1-D memmap of every token, documents concatenated (each ending with EOS).
    ``lengths`` (N,) int32 and ``pointers`` (N,) int64 byte offsets are views into the index file;
    ``doc_offsets`` (N+1,) int64 token offsets is derived on first use. ``ds[i]`` is document i.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.bin_path, self.idx_path = _paths(prefix)
        for p in (self.bin_path, self.idx_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p} not found; write it with `pretrain prepare` (pretrain.datamodules.prepare)"
                )
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != INDEX_MAGIC:
            raise InputError(f"{self.idx_path} is not a Megatron MMIDIDX index (bad magic); re-run prepare")
        _, version, code, n, n_docs = _HEADER.unpack(head)
        if version != INDEX_VERSION or code not in DTYPE_CODES:
            raise InputError(f"{self.idx_path}: unsupported version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + n * 4 + n * 8 + n_docs * 8
        if self.idx_path.stat().st_size < expected:
            raise InputError(
                f"{self.idx_path} is truncated ({self.idx_path.stat().st_size} < {expected} bytes)"
            )
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.lengths = np.frombuffer(index, dtype=np.int32, count=n, offset=off)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=n, offset=off + 4 * n)
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=n_docs, offset=off + 12 * n)
        size = self.bin_path.stat().st_size
        if size % self.dtype.itemsize:
            raise InputError(f"{self.bin_path} size {size} is not a multiple of {self.dtype} itemsize")
        self.tokens = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size else np.empty(0, dtype=self.dtype)
        )
        if n and int(self.pointers[-1]) // self.dtype.itemsize + int(self.lengths[-1]) != len(self.tokens):
            raise InputError(
                f"{self.bin_path} does not match {self.idx_path} (token count differs); re-run prepare"
            )

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        """(N+1,) int64: document i spans ``tokens[doc_offsets[i]:doc_offsets[i+1]]``."""
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return offsets

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start : start + int(self.lengths[i])])
