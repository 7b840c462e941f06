"""Corpus preparation: raw text -> token shards (``train``/``val`` in Megatron ``.bin/.idx`` layout).

``prepare`` streams documents (``datamodules.corpus``), tokenizes them in batches with ``encode_batch``,
appends EOS to each document and appends the tokens to the split's ``.bin`` as it goes, so peak memory is a
few batches whatever the corpus size. ``num_workers=0`` tokenizes in this process (the Rust encoder's own
threads); ``num_workers=N`` sends whole batches to N worker processes that tokenize and pack them (one
thread each) while this process reads and writes; results are written in input order, so the output is
byte-identical whatever the number of workers. Document ``i`` (its position in the input stream)
goes to ``val`` iff ``u(i) < val_fraction`` where ``u(i) = splitmix64(i + splitmix64(seed)) / 2**64``:
deterministic, independent of batching, and stable when documents are appended.

The output directory holds ``train.bin/.idx``, ``val.bin/.idx``, ``tokenizer.json`` (a copy) and
``meta.json`` (dtype, vocab size, EOS, counts, cache key). The cache key hashes the input contents, the
tokenizer JSON and the settings: an unchanged run returns the existing directory at once, a changed input
rebuilds it (with a warning). Builds happen in a temporary sibling directory that replaces ``out_dir``
only when complete; on error the temporary directory is removed and the previous ``out_dir`` is kept.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import uuid
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from datamodules.atomic import replace_path
from datamodules.corpus import (
    INVALID_UTF8_POLICIES,
    CorpusStats,
    Source,
    batched,
    document_mode,
    iter_documents,
    resolve_sources,
)
from datamodules.hashing import splitmix64
from datamodules.indexed import IndexedWriter, token_dtype
from datamodules.tokenizer import load_tokenizer, resolve_eos

FORMAT_VERSION = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
_MASK64 = (1 << 64) - 1


def val_mask(doc_indices: np.ndarray, seed: int, val_fraction: float) -> np.ndarray:
    """(D,) bool: which documents (by stream index) belong to the validation split."""
    salt = splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    u = splitmix64(doc_indices.astype(np.uint64) + salt) >> np.uint64(11)  # 53 uniform bits
    return u.astype(np.float64) * 2.0**-53 < val_fraction


def pack_batch(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists with ``eos_id`` after each: returns tokens (sum(L_i)+D,) and lengths (D,)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    ends = np.cumsum(lengths) - 1
    out = np.empty(int(ends[-1]) + 1 if len(ids) else 0, dtype=dtype)
    body = np.ones(len(out), dtype=bool)
    body[ends] = False
    out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=len(out) - len(ids))
    out[ends] = eos_id
    return out, lengths


def _encode_ahead(batches: Iterable[list[str]], encode) -> Iterator[tuple[list[str], list]]:
    """Yield ``(batch, encode(batch))`` in order, encoding the next batch in a thread meanwhile: the Rust
    encoder releases the GIL, so reading, packing and writing overlap with tokenization."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for batch in batches:
            future = pool.submit(encode, batch, add_special_tokens=False)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (batch, future)
        if pending is not None:
            yield pending[0], pending[1].result()


_worker_state: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    """Worker-process set-up: one tokenizer per process, single-threaded (the processes are the parallelism)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = Tokenizer.from_str(tokenizer_json)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    _worker_state.update(encode=encode, eos_id=eos_id, dtype=np.dtype(dtype))


def _encode_pack(batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: ``pack_batch`` of the batch's token ids (arrays pickle far cheaper than id lists)."""
    state = _worker_state
    encodings = state["encode"](batch, add_special_tokens=False)
    return pack_batch([e.ids for e in encodings], state["eos_id"], state["dtype"])


def _packed_in_processes(
    batches: Iterable[list[str]], num_workers: int, tokenizer: Tokenizer, eos_id: int, dtype: np.dtype
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``pack_batch`` of every batch, computed by ``num_workers`` spawned processes, yielded in input order;
    at most ``2 * num_workers`` batches are in flight (bounded memory)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    init = (tokenizer.to_str(), eos_id, np.dtype(dtype).name)
    with context.Pool(num_workers, initializer=_init_worker, initargs=init) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_pack, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _packed_here(
    batches: Iterable[list[str]], tokenizer: Tokenizer, eos_id: int, dtype: np.dtype
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    # encode_batch_fast (tokenizers >= 0.20) skips character offsets, which we do not need
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for _, encodings in _encode_ahead(batches, encode):
        yield pack_batch([e.ids for e in encodings], eos_id, dtype)


def read_meta(prepared_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared directory (``FileNotFoundError`` if it is not one)."""
    path = Path(prepared_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{prepared_dir} is not a prepared corpus (no {META_FILE}); run `pretrain prepare`"
        )
    return json.loads(path.read_text())


def _complete(directory: Path, meta: dict) -> bool:
    """Every file present, and each split's ``.bin`` exactly as long as the token count ``meta`` records."""
    files = [META_FILE, "tokenizer.json"] + [f"{s}{ext}" for s in SPLITS for ext in (".bin", ".idx")]
    if not all((directory / f).is_file() for f in files):
        return False
    itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
    splits = meta.get("splits", {})
    return all(
        (directory / f"{s}.bin").stat().st_size == splits.get(s, {}).get("tokens", -1) * itemsize
        for s in SPLITS
    )


def _remove_leftovers(out_dir: Path) -> None:
    """Temporary and old directories that killed runs of ``prepare`` left next to ``out_dir``."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _stale_reason(old: dict, inputs: list[dict], tokenizer_hash: str, settings: dict) -> str:
    old_inputs = {i["location"]: i["sha256"] for i in old.get("inputs", [])}
    changed = [
        i["location"]
        for i in inputs
        if i["location"] in old_inputs and old_inputs[i["location"]] != i["sha256"]
    ]
    if changed:
        return f"input file(s) changed since it was prepared (content hash differs): {changed}"
    if [i["location"] for i in inputs] != [i["location"] for i in old.get("inputs", [])]:
        return "the list of inputs differs"
    if old.get("tokenizer_sha256") != tokenizer_hash:
        return "the tokenizer differs"
    return f"the settings differ ({old.get('settings')} -> {settings})"


def _build(
    tmp: Path,
    tokenizer: Tokenizer,
    sources: list[Source],
    eos_id: int,
    dtype: np.dtype,
    *,
    val_fraction: float,
    seed: int,
    document: str,
    text_field: str,
    on_invalid_utf8: str,
    batch_docs: int,
    batch_chars: int,
    num_workers: int,
    progress: bool,
) -> tuple[dict, CorpusStats]:
    stats = CorpusStats()
    docs = iter_documents(
        sources, document=document, text_field=text_field, on_invalid_utf8=on_invalid_utf8, stats=stats
    )
    batches = batched(docs, batch_docs, batch_chars)
    if num_workers > 0:
        packed = _packed_in_processes(batches, num_workers, tokenizer, eos_id, dtype)
    else:
        packed = _packed_here(batches, tokenizer, eos_id, dtype)
    total = sum(s.size for s in sources) or None
    with (
        IndexedWriter(tmp / "train", dtype) as train,
        IndexedWriter(tmp / "val", dtype) as val,
        tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar,
    ):
        first = 0
        for tokens, lengths in packed:
            is_val = val_mask(np.arange(first, first + len(lengths)), seed, val_fraction)
            token_is_val = np.repeat(is_val, lengths)
            train.add_documents(tokens[~token_is_val], lengths[~is_val])
            val.add_documents(tokens[token_is_val], lengths[is_val])
            first += len(lengths)
            bar.update(stats.bytes_read - bar.n)
        counts = {
            name: {"documents": w.num_documents, "tokens": w.num_tokens}
            for name, w in zip(SPLITS, (train, val))
        }
    if stats.documents == 0:
        raise ValueError(
            f"the corpus is empty: no non-blank documents in {[s.location for s in sources]} "
            f"({stats.skipped_empty} blank documents skipped); check the inputs, text_field and document mode"
        )
    return counts, stats


def prepare(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer: str | os.PathLike | Tokenizer,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.01,
    seed: int = 0,
    document: str = "blank_line",
    text_field: str = "text",
    split: str = "train",
    on_invalid_utf8: str = "error",
    eos_token: str | None = None,
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    num_workers: int = 0,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """Tokenize ``inputs`` into ``out_dir`` (see module doc) and return its ``meta.json`` contents.

    ``tokenizer``: a path for ``load_tokenizer`` or a ``tokenizers.Tokenizer``. ``eos_token``: appended to
    every document; default ``</s>``, else ``<|endoftext|>``. ``document``/``text_field``/``split``/
    ``on_invalid_utf8``: how documents are read (``datamodules.corpus``). ``batch_docs``/``batch_chars``
    bound one tokenization batch, hence peak memory. ``num_workers``: tokenizing processes (0: this process,
    with the encoder's threads); the output does not depend on it. ``force`` rebuilds even when the cache is valid.
    The returned dict also says ``cache_hit`` (True when the existing directory was reused as is).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1)")
    document_mode(document)  # ValueError naming the conventions
    if on_invalid_utf8 not in INVALID_UTF8_POLICIES:
        raise ValueError(f"on_invalid_utf8={on_invalid_utf8!r}; choose one of {INVALID_UTF8_POLICIES}")
    if batch_docs < 1 or batch_chars < 1:
        raise ValueError(f"batch_docs={batch_docs} and batch_chars={batch_chars} must be positive")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0 (0 tokenizes in this process)")
    out_dir = Path(out_dir).expanduser()
    tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    eos, eos_id = resolve_eos(tokenizer, eos_token)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    sources = resolve_sources(inputs, split)
    local = [s for s in sources if s.kind != "hf_hub"]
    if local and len(local) == len(sources) and all(s.size == 0 for s in local):
        raise ValueError(
            f"the corpus is empty: every input is an empty file ({[s.location for s in sources]})"
        )

    tokenizer_json = tokenizer.to_str()
    tokenizer_hash = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    input_info = [{"kind": s.kind, "location": s.location, "sha256": s.fingerprint()} for s in sources]
    settings = {
        "val_fraction": val_fraction,
        "seed": seed,
        "document": document,
        "text_field": text_field,
        "split": split,
        "on_invalid_utf8": on_invalid_utf8,
        "eos_token": eos,
    }
    key_material = {
        "format_version": FORMAT_VERSION,
        "inputs": [i["sha256"] for i in input_info],
        "tokenizer": tokenizer_hash,
        "settings": settings,
    }
    cache_key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()

    if out_dir.exists():
        if not (out_dir / META_FILE).is_file():
            if out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()
            else:
                raise ValueError(f"{out_dir} exists and is not a prepared corpus; choose another out_dir")
        else:
            old = read_meta(out_dir)
            complete = _complete(out_dir, old)
            if old.get("cache_key") == cache_key and complete and not force:
                return {**old, "cache_hit": True}
            if old.get("cache_key") != cache_key:
                reason = _stale_reason(old, input_info, tokenizer_hash, settings)
                warnings.warn(f"prepared corpus {out_dir} is stale: {reason}; rebuilding it", stacklevel=2)
            elif not complete:
                warnings.warn(
                    f"prepared corpus {out_dir} is damaged (missing or truncated files); rebuilding it",
                    stacklevel=2,
                )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        counts, stats = _build(
            tmp,
            tokenizer,
            sources,
            eos_id,
            dtype,
            val_fraction=val_fraction,
            seed=seed,
            document=document,
            text_field=text_field,
            on_invalid_utf8=on_invalid_utf8,
            batch_docs=batch_docs,
            batch_chars=batch_chars,
            num_workers=num_workers,
            progress=progress,
        )
        notes = stats.warnings(on_invalid_utf8)
        if val_fraction > 0 and counts["val"]["documents"] == 0:
            notes.append(f"val_fraction={val_fraction} selected no document; the val split is empty")
        for note in notes:
            warnings.warn(note, stacklevel=2)
        meta = {
            "format": "megatron-mmidx",
            "format_version": FORMAT_VERSION,
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab_size,
            "eos_token": eos,
            "eos_id": eos_id,
            "splits": counts,
            "documents": stats.documents,
            "skipped_empty_documents": stats.skipped_empty,
            "invalid_utf8_lines": stats.invalid_utf8_lines,
            "bytes_read": stats.bytes_read,
            "warnings": notes,
            "cache_key": cache_key,
            "tokenizer_sha256": tokenizer_hash,
            "inputs": input_info,
            "settings": settings,
        }
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        replace_path(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**meta, "cache_hit": False}
