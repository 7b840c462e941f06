"""Megatron .bin/.idx layout: round trip, byte layout read independently, O(1) open (pages touched and bytes
allocated counted), bad files."""

from __future__ import annotations

import gc
import os
import re
import resource
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shards import write_shard

from pretrain.datamodules.indexed import IndexedDataset, IndexedWriter, token_dtype


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
    write_shard(tmp_path / "d", docs, np.uint16)
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
    write_shard(prefix, docs, token_dtype(vocab))
    ds = IndexedDataset(prefix)
    assert ds.dtype == (np.int32 if wide else np.uint16)
    assert len(ds) == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert ds.doc_offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()


def test_streamed_index_across_blocks(tmp_path, monkeypatch):
    import pretrain.datamodules.indexed as mod

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


def open_cost(prefix) -> tuple[int, int]:
    """(pages faulted in, bytes allocated) by opening ``prefix`` and reading its last document: what any pass
    over the index costs (its pages are memory-mapped: each one touched is a page fault), counted, not timed."""
    gc.collect()
    tracemalloc.start()
    before = resource.getrusage(resource.RUSAGE_SELF)
    ds = IndexedDataset(prefix)
    ds[len(ds) - 1]
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt, peak


def test_open_is_constant_time(tmp_path):
    """2,000,000 documents open like 1,000: the same pages touched and bytes allocated. A pass over their lengths
    (8 MB) faults in ~100 pages more (the kernel maps 16 per fault), a copy of them allocates 8 MB more."""
    costs = {}
    for n_docs in (1_000, 2_000_000):
        with IndexedWriter(tmp_path / f"c{n_docs}", np.uint16) as w:
            w.add_documents(np.ones(4 * n_docs, np.uint16), np.full(n_docs, 4))
        costs[n_docs] = open_cost(tmp_path / f"c{n_docs}")
    (small_faults, small_bytes), (big_faults, big_bytes) = costs[1_000], costs[2_000_000]
    assert big_faults <= small_faults + 32, costs
    assert big_bytes <= small_bytes + 16 * 1024, costs


def _peak_rss_kb_of(fn) -> int:
    """How far peak RSS (VmHWM) rose above the RSS before ``fn()``: the peak is reset first (/proc/self/clear_refs)."""
    status = Path("/proc/self/status")
    Path("/proc/self/clear_refs").write_text("5")
    before = int(re.search(r"VmRSS:\s+(\d+) kB", status.read_text()).group(1))
    fn()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1)) - before


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset"
)
def test_finalize_memory_does_not_grow_with_the_document_count(tmp_path):
    """Writing the index of 4,000,000 documents raises peak RSS by under 4 MB: the 16 MB of spilled lengths
    are read in blocks (memory-mapped, every page of them would count as resident, +16 MB)."""
    n_docs = 4_000_000
    writer = IndexedWriter(tmp_path / "big", np.uint16)
    writer.add_documents(np.ones(n_docs, np.uint16), np.ones(n_docs, np.int64))
    rise = _peak_rss_kb_of(writer.finalize)
    assert rise < 4096, rise
    assert len(IndexedDataset(tmp_path / "big")) == n_docs


def test_empty_split(tmp_path):
    write_shard(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.doc_offsets.tolist() == [0]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        IndexedDataset(tmp_path / "missing")
    write_shard(tmp_path / "b", [[1, 2, 3]], np.uint16)
    (tmp_path / "b.idx").write_bytes(b"NOTMAGIC!" + (tmp_path / "b.idx").read_bytes()[9:])
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(tmp_path / "b")
    write_shard(tmp_path / "t", [[1, 2, 3]], np.uint16)
    (tmp_path / "t.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="token count"):
        IndexedDataset(tmp_path / "t")
    with pytest.raises(ValueError, match="do not fit"):
        write_shard(tmp_path / "o", [[70_000]], np.uint16)
    assert not (tmp_path / "o.bin").exists()  # aborted writer removes partial files
