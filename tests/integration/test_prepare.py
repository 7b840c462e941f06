"""Corpus reading and preparation: documents, formats, split, packing, cache, bad input, bounded memory."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from pretrain.datamodules.corpus import CorpusStats, batched, iter_documents, resolve_sources
from pretrain.datamodules.indexed import IndexedDataset
from pretrain.datamodules.prepare import pack_batch, prepare, read_meta, val_mask
from pretrain.datamodules.tokenizer import train_bpe

TEXT = "first para line one\nline two\n\n \nsecond para\n\n\nthird\n"


def docs_of(path, **kw) -> list[str]:
    return list(iter_documents(resolve_sources(path), **kw))


@pytest.fixture(scope="module")
def tokenizer(shipped_corpus, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(shipped_corpus, 600, path, show_progress=False)


@pytest.fixture(scope="module")
def tokenizer_path(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokp") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


# ----------------------------------------------------------------------------- reading


def test_document_modes(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    assert docs_of(tmp_path / "a.txt") == ["first para line one\nline two", "second para", "third"]
    assert docs_of(tmp_path / "a.txt", document="line") == [
        "first para line one",
        "line two",
        "second para",
        "third",
    ]
    assert docs_of(tmp_path / "a.txt", document="file") == [TEXT]
    with pytest.raises(ValueError, match="document='para'"):
        docs_of(tmp_path / "a.txt", document="para")


def test_blocks_do_not_split_documents(tmp_path, monkeypatch):
    from pretrain.datamodules import corpus

    monkeypatch.setattr(corpus, "_BLOCK", 5)  # lines and paragraphs straddle many blocks
    (tmp_path / "a.txt").write_text(TEXT + "a very long line that spans blocks\n")
    assert docs_of(tmp_path / "a.txt") == [
        "first para line one\nline two",
        "second para",
        "third\na very long line that spans blocks",
    ]


def _reference_documents(text: str, mode: str) -> list[str]:
    """Per-line definition: lines split at "\\n"; a blank line is empty or whitespace-only."""
    lines = text.split("\n")
    if mode == "file":
        return [text] if text.strip() else []
    if mode == "line":
        return [line for line in lines if line.strip()]
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    return paragraphs + (["\n".join(current)] if current else [])


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab \t\r\n\x0b\u2028é", max_size=60),
    block=st.integers(1, 12),
    mode=st.sampled_from(["line", "blank_line", "file"]),
)
def test_documents_match_line_definition(tmp_path_factory, text, block, mode):
    """Block-wise splitting equals the per-line definition for any text and block size."""
    from pretrain.datamodules import corpus

    path = tmp_path_factory.mktemp("h") / "t.txt"
    path.write_bytes(text.encode())
    stats = CorpusStats()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "_BLOCK", block)
        assert docs_of(path, document=mode, stats=stats) == _reference_documents(text, mode)
    assert stats.bytes_read == len(text.encode())


def test_formats_and_inputs(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["alpha beta", "gamma\n\ndelta", "épsilon ☃"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("".join(json.dumps({"body": t, "n": 1}) + "\n" for t in texts))
    pq.write_table(pa.table({"body": texts}), tmp_path / "d" / "b.parquet")
    with gzip.open(tmp_path / "d" / "c.txt.gz", "wt") as f:
        f.write("\n\n".join(texts[:1] + texts[2:]))
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "saved"))
    assert docs_of(tmp_path / "d" / "a.jsonl", text_field="body") == texts
    assert docs_of(tmp_path / "d" / "b.parquet", text_field="body") == texts
    assert docs_of(tmp_path / "d" / "c.txt.gz") == [texts[0], texts[2]]
    assert docs_of(tmp_path / "saved", text_field="body") == texts
    assert docs_of(tmp_path / "d", text_field="body") == texts + texts + [texts[0], texts[2]]  # sorted files
    assert docs_of(str(tmp_path / "d" / "*.parquet"), text_field="body") == texts
    with pytest.raises(ValueError, match=r"a\.jsonl:1: record has no field 'text'"):
        docs_of(tmp_path / "d" / "a.jsonl")
    with pytest.raises(ValueError, match="no column 'text'"):
        docs_of(tmp_path / "d" / "b.parquet")


def test_missing_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_sources(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="matches no files"):
        resolve_sources(str(tmp_path / "*.txt"))
    with pytest.raises(ValueError, match="no corpus inputs"):
        resolve_sources([])


def test_invalid_utf8_policies(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good one\n\nbad \xff\xfe here\nstill para\n\n\xc3\n")
    with pytest.raises(ValueError, match=r"bad\.txt:3: invalid UTF-8.*on_invalid_utf8=replace \(or skip\)"):
        docs_of(path)
    stats = CorpusStats()
    assert docs_of(path, on_invalid_utf8="replace", stats=stats) == [
        "good one",
        "bad \ufffd\ufffd here\nstill para",
        "\ufffd",
    ]
    assert stats.invalid_utf8_lines == 2 and stats.first_invalid_utf8.endswith("bad.txt:3")
    assert "2 line(s) of invalid UTF-8 replaced" in stats.warnings("replace")[0]
    stats = CorpusStats()
    assert docs_of(path, on_invalid_utf8="skip", stats=stats) == ["good one", "still para"]
    assert stats.invalid_utf8_lines == 2
    # JSONL: the skipped record keeps later line numbers exact
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: field 'text' is int"):
        docs_of(tmp_path / "bad.jsonl", on_invalid_utf8="skip")


# ----------------------------------------------------------------------------- packing and split


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 65_000), max_size=12), min_size=1, max_size=20), st.integers(0, 65_535)
)
def test_pack_batch(ids, eos):
    tokens, lengths = pack_batch(ids, eos, np.dtype(np.uint16))
    assert lengths.tolist() == [len(d) + 1 for d in ids]
    assert tokens.tolist() == [t for d in ids for t in [*d, eos]]


def test_val_mask_is_deterministic_and_calibrated():
    idx = np.arange(200_000)
    mask = val_mask(idx, seed=3, val_fraction=0.05)
    assert abs(mask.mean() - 0.05) < 0.003
    assert (val_mask(idx[1234:5678], 3, 0.05) == mask[1234:5678]).all()  # independent of batching
    assert (val_mask(idx, 4, 0.05) != mask).any()
    assert not val_mask(idx, 3, 0.0).any()


# ----------------------------------------------------------------------------- prepare


def _all_docs(out_dir) -> dict[str, list[list[int]]]:
    return {s: [d.tolist() for d in IndexedDataset(out_dir / s)] for s in ("train", "val")}


def test_prepare_contents(tmp_path, tokenizer, tokenizer_path, shipped_corpus):
    out = tmp_path / "prep"
    meta = prepare(shipped_corpus, tokenizer_path, out, val_fraction=0.1, seed=7, progress=False)
    docs = docs_of(shipped_corpus)
    eos = tokenizer.token_to_id("</s>")
    expected = [e.ids + [eos] for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    is_val = val_mask(np.arange(len(docs)), 7, 0.1)
    got = _all_docs(out)
    assert got["train"] == [d for d, v in zip(expected, is_val) if not v]
    assert got["val"] == [d for d, v in zip(expected, is_val) if v]
    assert meta == {**read_meta(out), "cache_hit": False}
    assert meta["dtype"] == "uint16" and meta["eos_id"] == eos and meta["documents"] == len(docs)
    assert meta["splits"]["val"] == {"documents": int(is_val.sum()), "tokens": sum(map(len, got["val"]))}
    ds = IndexedDataset(out / "train")
    assert ds.tokens.dtype == np.uint16 and (ds.tokens[ds.doc_offsets[1:] - 1] == eos).all()
    assert Tokenizer.from_file(str(out / "tokenizer.json")).to_str() == tokenizer.to_str()
    # batching does not change a single byte
    small = prepare(
        shipped_corpus, tokenizer, tmp_path / "small", val_fraction=0.1, seed=7, batch_docs=7, progress=False
    )
    assert small["cache_key"] == meta["cache_key"]
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (out / name).read_bytes() == (tmp_path / "small" / name).read_bytes()


def test_worker_processes_write_identical_bytes(tmp_path, tokenizer, shipped_corpus):
    """Batches tokenized in 2 worker processes (several in flight, finishing in any order) give the same
    bytes as 1 worker and as the in-process encoder."""
    outs = {}
    for workers in (0, 1, 2):
        outs[workers] = tmp_path / f"w{workers}"
        prepare(
            shipped_corpus,
            tokenizer,
            outs[workers],
            val_fraction=0.1,
            batch_docs=97,
            num_workers=workers,
            progress=False,
        )
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "meta.json"):
        reference = (outs[1] / name).read_bytes()
        assert (outs[2] / name).read_bytes() == reference and (outs[0] / name).read_bytes() == reference
    with pytest.raises(ValueError, match="num_workers=-1"):
        prepare(shipped_corpus, tokenizer, tmp_path / "bad", num_workers=-1, progress=False)


def test_prepare_wide_vocab_uses_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "</s>": 70_001}
    wide = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wide.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "c.txt").write_text("w1 w69999 w5\n\nw65536 nope\n")
    meta = prepare(tmp_path / "c.txt", wide, tmp_path / "out", val_fraction=0.0, progress=False)
    assert meta["dtype"] == "int32"
    assert _all_docs(tmp_path / "out")["train"] == [[1, 69_999, 5, 70_001], [65_536, 70_000, 70_001]]


def test_cache_hit_change_and_atomic_rebuild(tmp_path, tokenizer):
    src = tmp_path / "c.txt"
    src.write_text("one two three\n\nfour five\n")
    out = tmp_path / "prep"
    first = prepare(src, tokenizer, out, val_fraction=0.0, progress=False)
    stamp = (out / "train.bin").stat().st_mtime_ns
    t = time.perf_counter()
    assert prepare(src, tokenizer, out, val_fraction=0.0, progress=False) == {**first, "cache_hit": True}
    assert time.perf_counter() - t < 1.0 and (out / "train.bin").stat().st_mtime_ns == stamp

    src.write_text("one two three\n\nfour five six\n")  # same name, new content
    with pytest.warns(UserWarning, match=r"stale: input file\(s\) changed.*c\.txt"):
        second = prepare(src, tokenizer, out, val_fraction=0.0, progress=False)
    assert second["cache_key"] != first["cache_key"] and second["splits"]["train"]["documents"] == 2
    assert tokenizer.decode(_all_docs(out)["train"][1]) == "four five six"

    with pytest.warns(UserWarning, match="settings differ"):
        prepare(src, tokenizer, out, val_fraction=0.0, seed=1, progress=False)

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    src.write_bytes(b"fine\n\nbroken \xff\n")  # the rebuild fails: the previous corpus must survive intact
    with pytest.warns(UserWarning, match="stale"), pytest.raises(ValueError, match="invalid UTF-8"):
        prepare(src, tokenizer, out, val_fraction=0.0, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "prep"]  # no temporary directory left


def test_a_plain_prepare_removes_the_tasks_a_killed_executor_run_left(tmp_path, tokenizer):
    """`pretrain prepare R --executor local --tasks 4` killed (SIGKILL), then `pretrain prepare R`: the output was
    built, but `.<dir>.tasks-<hex>/` (up to a whole corpus of shards) stayed next to it for good. Found by the
    #32 sweep."""
    src = tmp_path / "c.txt"
    src.write_text("one two three\n\nfour five\n")
    staging = tmp_path / ".prep.tasks-e8e1c7316c56"
    (staging / "task-00000").mkdir(parents=True)
    (staging / "task-00000" / "train.bin").write_bytes(b"shards of a killed run")
    prepare(src, tokenizer, tmp_path / "prep", val_fraction=0.0, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "prep"]


def test_prepare_bad_input(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(tmp_path / "missing.txt", tokenizer, tmp_path / "o", progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        prepare(tmp_path / "empty.txt", tokenizer, tmp_path / "o", progress=False)
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(ValueError, match="corpus is empty"):
        prepare(tmp_path / "blank.txt", tokenizer, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    (tmp_path / "c.txt").write_text("some text\n")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(tmp_path / "c.txt", tokenizer, tmp_path / "o", val_fraction=1.0)
    with pytest.raises(ValueError, match="eos_token"):
        prepare(tmp_path / "c.txt", tokenizer, tmp_path / "o", eos_token="<|endoftext|>")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a prepared corpus"):
        prepare(tmp_path / "c.txt", tokenizer, tmp_path / "foreign", progress=False)
    (tmp_path / "bad.txt").write_bytes(b"ok\n\n\xff\n")
    with pytest.warns(UserWarning, match="1 line.* invalid UTF-8 skipped"):
        meta = prepare(
            tmp_path / "bad.txt",
            tokenizer,
            tmp_path / "o",
            on_invalid_utf8="skip",
            val_fraction=0,
            progress=False,
        )
    assert meta["invalid_utf8_lines"] == 1 and meta["documents"] == 1


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import re, sys
    from pathlib import Path
    from pretrain.datamodules import corpus, indexed
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import load_tokenizer

    corpus._BLOCK, indexed._CHUNK = 1 << 16, 1 << 12  # small buffers: the small corpus already fills them
    tok = load_tokenizer(sys.argv[1])
    prepare(sys.argv[2], tok, sys.argv[3] + "-warmup", batch_chars=1 << 15, progress=False)  # fill caches
    peaks = []
    for corpus_path, out in zip(sys.argv[2::2], sys.argv[3::2]):
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak RSS) to the current RSS
        prepare(corpus_path, tok, out, batch_chars=1 << 15, progress=False)
        peaks.append(int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)))
    print(*peaks)
    """
)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset"
)
def test_peak_memory_independent_of_corpus_size(tmp_path, tokenizer_path, shipped_corpus):
    """Peak RSS (VmHWM, in a fresh process, caches warm) while preparing a 4x larger corpus stays within
    3 MiB of the peak for the small one (run-to-run noise is up to ~1.5 MiB, independent of size); keeping
    the extra 3.3 MB of documents (~4.7 MB as Python strings) or their token lists would exceed it."""
    text = shipped_corpus.read_text()
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text(text)
    large.write_text(text * 4)
    args = [str(tokenizer_path), str(small), str(tmp_path / "a"), str(large), str(tmp_path / "b")]
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    peak_small, peak_large = map(int, result.stdout.split())
    assert peak_large - peak_small < 3072, (peak_small, peak_large)
    tokens = [IndexedDataset(tmp_path / d / "train").num_tokens for d in "ab"]
    assert tokens[1] > 3.5 * tokens[0]


def test_the_encoding_thread_packs_its_own_id_lists(tmp_path, tokenizer, shipped_corpus, monkeypatch):
    """In-process prepare encodes and packs each batch in one thread: the encoder's id lists never reach the
    thread that reads and writes, only packed arrays do. (Packed in the reading thread, they fragmented glibc's
    heaps: peak RSS crept up with the corpus size, 127 -> 144 MB from 50 to 500 MB of text.)"""
    from pretrain.datamodules import prepare as module

    threads: dict[str, set[int]] = {"encode": set(), "pack": set()}
    encode, pack = module.Encoder.__call__, module.pack_batch

    def recording(name, fn):
        def call(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(module.Encoder, "__call__", recording("encode", encode))
    monkeypatch.setattr(module, "pack_batch", recording("pack", pack))
    prepare(shipped_corpus, tokenizer, tmp_path / "p", batch_docs=64, progress=False)
    assert threads["encode"] == threads["pack"] and threading.get_ident() not in threads["pack"], threads


def test_batched_bounds():
    docs = ["a" * 10] * 25
    assert [len(b) for b in batched(docs, max_docs=10)] == [10, 10, 5]
    assert [len(b) for b in batched(docs, max_docs=100, max_chars=35)] == [4] * 6 + [1]
