"""Megatron .bin/.idx layout: round trip, byte layout read independently, O(1) open, bad files."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.indexed import IndexedDataset, IndexedWriter, token_dtype, write_indexed


def _parse_idx_by_spec(path):
    """Independent reader following Megatron's _IndexReader field order."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, n_docs = struct.unpack_from("<QBQQ", raw, 9)
    off = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(raw, np.int32, n, off)
    pointers = np.frombuffer(raw, np.int64, n, off + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, n_docs, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * n_docs
    return version, code, lengths, pointers, doc_idx


def test_layout_matches_megatron_spec(tmp_path):
    docs = [[5, 6, 1], [7, 1], [1], [9, 9, 9, 9, 1]]
    write_indexed(tmp_path / "d", docs, np.uint16)
    version, code, lengths, pointers, doc_idx = _parse_idx_by_spec(tmp_path / "d.idx")
    assert version == 1 and code == 8  # Megatron DType.uint16
    assert lengths.tolist() == [3, 2, 1, 5]
    assert pointers.tolist() == [0, 6, 10, 12]  # byte offsets, 2 bytes per token
    assert doc_idx.tolist() == [0, 1, 2, 3, 4]
    raw = np.fromfile(tmp_path / "d.bin", dtype="<u2")
    assert raw.tolist() == [t for d in docs for t in d]


@settings(max_examples=30, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 70_000), max_size=20), max_size=15),
    wide=st.booleans(),
)
def test_round_trip(tmp_path_factory, docs, wide):
    vocab = 70_001 if wide else 65_536
    docs = [[t % vocab for t in d] for d in docs]
    prefix = tmp_path_factory.mktemp("rt") / "x"
    write_indexed(prefix, docs, token_dtype(vocab))
    ds = IndexedDataset(prefix)
    assert ds.dtype == (np.int32 if wide else np.uint16)
    assert len(ds) == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert ds.doc_offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()


def test_streamed_index_across_blocks(tmp_path, monkeypatch):
    import datamodules.indexed as mod

    monkeypatch.setattr(mod, "_CHUNK", 7)  # force many streamed blocks in finalize()
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=50)
    tokens = rng.integers(0, 1000, size=int(lengths.sum()))
    with IndexedWriter(tmp_path / "s", np.int32) as w:
        cut = int(lengths[:20].sum())
        w.add_documents(tokens[:cut], lengths[:20])
        w.add_documents(tokens[cut:], lengths[20:])
    _, code, lens, ptrs, doc_idx = _parse_idx_by_spec(tmp_path / "s.idx")
    assert code == 4 and lens.tolist() == lengths.tolist()
    assert ptrs.tolist() == (4 * np.concatenate([[0], np.cumsum(lengths)[:-1]])).tolist()
    assert doc_idx.tolist() == list(range(51))
    assert not (tmp_path / "s.len.tmp").exists()


def test_open_is_constant_time(tmp_path):
    def open_time(n_docs):
        prefix = tmp_path / f"c{n_docs}"
        lengths = np.full(n_docs, 4)
        with IndexedWriter(prefix, np.uint16) as w:
            w.add_documents(np.ones(4 * n_docs, np.uint16), lengths)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            ds = IndexedDataset(prefix)
            _ = ds[n_docs - 1]
            best = min(best, time.perf_counter() - t)
        return best

    small, big = open_time(1_000), open_time(2_000_000)
    # 2000x more documents; a linear scan would take >= 100x longer. Allow generous noise.
    assert big < 20 * small + 0.01


def test_empty_split(tmp_path):
    write_indexed(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.doc_offsets.tolist() == [0]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        IndexedDataset(tmp_path / "missing")
    write_indexed(tmp_path / "b", [[1, 2, 3]], np.uint16)
    (tmp_path / "b.idx").write_bytes(b"NOTMAGIC!" + (tmp_path / "b.idx").read_bytes()[9:])
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(tmp_path / "b")
    write_indexed(tmp_path / "t", [[1, 2, 3]], np.uint16)
    (tmp_path / "t.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="token count"):
        IndexedDataset(tmp_path / "t")
    with pytest.raises(ValueError, match="do not fit"):
        write_indexed(tmp_path / "o", [[70_000]], np.uint16)
    assert not (tmp_path / "o.bin").exists()  # aborted writer removes partial files
