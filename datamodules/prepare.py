"""Corpus preparation: raw text -> token shards (``train``/``val`` in Megatron ``.bin/.idx`` layout).

``prepare`` streams documents (``pretrain.datamodules.corpus``), tokenizes them in batches with ``TextEncoder``
(special-token strings in a document are encoded as text, so a document never holds a control id of its own),
appends EOS to each document and appends the tokens to the split's ``.bin`` as it goes, so peak memory is a
few batches whatever the corpus size. A document longer than ``piece_chars`` characters is encoded in pieces
cut at single spaces between non-space characters, where the byte-level BPE's pre-tokenizer splits anyway,
so the ids are those of the whole document (checked by the tests) while memory stays bounded.
``num_workers=0`` tokenizes in this process (the Rust encoder's own threads); ``num_workers=N`` sends whole
batches to N worker processes that tokenize and pack them (one thread each) while this process reads and
writes; results are written in input order, so the output is byte-identical whatever the number of workers.

Validation split. The position of a document in the input stream is ``(f, i)``: the ordinal ``f`` of its input
file among the resolved inputs and its ordinal ``i`` among that file's non-blank documents. It goes to ``val``
iff ``u(f, i) < val_fraction`` with ``u = splitmix64(i + splitmix64(seed ^ f * 0x9E37...)) / 2**64``:
deterministic, independent of batching, stable when documents or files are appended, and computable by a
task that reads only some files or a byte range of one, given the number of documents before it
(``pretrain.datamodules.executors``), so every task count gives the same split.

``dedup="exact"`` drops a document whose text (BLAKE2b-128 of its UTF-8) equals an earlier one's in stream
order; a dropped document keeps its position, so the others' split does not change.

The output directory holds ``train.bin/.idx``, ``val.bin/.idx``, ``tokenizer.json`` (a copy) and
``meta.json`` (dtype, vocab size, EOS, counts, cache key). The cache key hashes the input contents, the
tokenizer JSON, the settings and the format version (``FORMAT_CHANGES``: a corpus written before a change of
what the bytes mean, such as special-token text becoming text in format 3, is stale): an unchanged run returns the existing directory at once, a changed input
rebuilds it (with a warning); ``stale_reason`` tells ``fit`` the same. A file's recorded hash is reused
while its size and modification time are unchanged. Builds happen in a temporary sibling directory that
replaces ``out_dir`` only when complete (under a lock, so two runs cannot write one directory); on error the
temporary directory is removed and the previous ``out_dir`` is kept.
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
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from pretrain.datamodules.corpus import (
    INVALID_UTF8_POLICIES,
    CorpusStats,
    Source,
    document_mode,
    iter_documents,
    resolve_sources,
)
from pretrain.datamodules.hashing import splitmix64
from pretrain.datamodules.indexed import IndexedDataset, IndexedWriter, token_dtype
from pretrain.datamodules.tokenizer import load_tokenizer, resolve_eos, text_encoder
from pretrain.errors import InputError
from pretrain.io import atomic_write_text, exclusive, naming, replace_path

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pretrain.datamodules.dataset import DocumentStarts  # imports torch: not before a config is checked

FORMAT_VERSION = 4  # what the newest format changed: FORMAT_CHANGES
FORMAT_CHANGES = {  # version -> what a corpus of an older version lacks
    2: "its validation split was keyed otherwise",
    3: "special-token strings in its documents (</s>, <mask>, <|endoftext|>...) were written as control ids; "
    "they are now encoded as the text they are",
    4: "its meta.json does not record that its index holds the document lengths (data.document_mask reads them)",
}
SPLITS = ("train", "val")
META_FILE = "meta.json"
DEDUP_MODES = ("none", "exact")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
PIECE_CHARS = 1 << 16  # longer documents are encoded in pieces of about this many characters


class CorpusSettings(TypedDict, total=False):
    """The keywords of ``plan`` that shape the corpus (and its cache key); ``prepare`` and
    ``pretrain.datamodules.executors.prepare_in_tasks`` take them as they are."""

    val_fraction: float
    seed: int
    document: str
    text_field: str
    split: str
    on_invalid_utf8: str
    eos_token: str | None
    dedup: Literal["none", "exact"]


def text_digest(text: str) -> bytes:
    """The content hash ``dedup="exact"`` compares: BLAKE2b-128 of the UTF-8 of ``text``."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def val_mask(
    doc_indices: np.ndarray, seed: int, val_fraction: float, file_index: int | np.ndarray = 0
) -> np.ndarray:
    """(D,) bool: which documents (by ordinal ``doc_indices`` in input file ``file_index``) are validation."""
    files = np.broadcast_to(np.asarray(file_index, dtype=np.uint64), np.shape(doc_indices))
    with np.errstate(over="ignore"):
        salt = splitmix64(np.uint64(seed & _MASK64) ^ (files * np.uint64(_GOLDEN)))
        u = splitmix64(np.asarray(doc_indices).astype(np.uint64) + salt) >> np.uint64(11)  # 53 uniform bits
    return u.astype(np.float64) * 2.0**-53 < val_fraction


def pack_batch(
    ids: Sequence[Sequence[int] | np.ndarray], eos_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists with ``eos_id`` after each: returns tokens (sum(L_i)+D,) and lengths (D,)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    ends = np.cumsum(lengths) - 1
    out = np.empty(int(ends[-1]) + 1 if len(ids) else 0, dtype=dtype)
    body = np.ones(len(out), dtype=bool)
    body[ends] = False
    if any(isinstance(x, np.ndarray) for x in ids):
        out[body] = np.concatenate([np.asarray(x, dtype=dtype) for x in ids])
    else:
        out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=len(out) - len(ids))
    out[ends] = eos_id
    return out, lengths


def _splits_like_gpt2(tokenizer: Tokenizer) -> bool:
    """Whether cutting text at a single space between non-spaces leaves the tokens unchanged: no normalizer, a
    GPT-2 style ``ByteLevel`` pre-tokenizer (the space starts the next pre-token) and no added token with a space."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and not any(" " in t for t in added)
    )


def _cut_ok(text: str, j: int) -> bool:
    return 0 < j < len(text) - 1 and not text[j - 1].isspace() and not text[j + 1].isspace()


def split_pieces(text: str, piece_chars: int) -> list[str]:
    """``text`` cut into pieces of about ``piece_chars`` characters, each cut before a space that sits between
    two non-space characters (the next such space when a window has none; no cut when the text has none)."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        cut = text.rfind(" ", start + 1, start + piece_chars + 1)
        while cut > start and not _cut_ok(text, cut):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:
            cut = text.find(" ", start + piece_chars)
            while cut != -1 and not _cut_ok(text, cut):
                cut = text.find(" ", cut + 1)
            if cut == -1:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class Encoder:
    """``texts -> token ids`` per text; texts longer than ``piece_chars`` are encoded piece by piece (when the
    tokenizer allows it, see ``_splits_like_gpt2``), about ``call_chars`` characters per encoder call, and
    returned as int64 arrays."""

    def __init__(self, tokenizer: Tokenizer, piece_chars: int = PIECE_CHARS, call_chars: int = 1 << 20):
        self.tokenizer, self.piece_chars = tokenizer, piece_chars
        self.call_chars, self.pieces_per_call = call_chars, max(1, call_chars // piece_chars)
        self.pieces_ok = _splits_like_gpt2(tokenizer)
        self._encode = text_encoder(tokenizer)  # special-token strings in documents stay text

    def __call__(self, texts: list[str]) -> list[list[int] | np.ndarray]:
        long = [i for i, t in enumerate(texts) if len(t) > self.piece_chars] if self.pieces_ok else []
        if not long:
            return list(self._encode(texts))
        out: list = [None] * len(texts)
        is_long = set(long)
        short = [i for i in range(len(texts)) if i not in is_long]
        for i, ids in zip(short, self._encode([texts[i] for i in short])):
            out[i] = ids
        for i in long:
            pieces = split_pieces(texts[i], self.piece_chars)
            parts = []
            for lo in range(0, len(pieces), self.pieces_per_call):
                parts += [
                    np.asarray(ids, dtype=np.int64)
                    for ids in self._encode(pieces[lo : lo + self.pieces_per_call])
                ]
            out[i] = np.concatenate(parts)
        return out


@dataclass
class Packer:
    """``batch -> pack_batch(encoder(batch))``: a batch's tokens (each document ending with ``eos_id``) and
    lengths, as ``dtype`` arrays."""

    encoder: Encoder
    eos_id: int
    dtype: np.dtype

    def __call__(self, batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return pack_batch(self.encoder(batch), self.eos_id, self.dtype)


def _packed_ahead(batches: Iterable[list[str]], pack: Packer) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``pack(batch)`` of every batch in order, the next one computed in a thread meanwhile (the Rust encoder
    releases the GIL, so reading and writing overlap with tokenization). The thread packs too: the encoder's
    id lists are then made and freed in one thread, and only the packed arrays cross over; packing them here
    instead kept peak RSS creeping up with the corpus size (glibc's per-thread heaps fragmenting)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for batch in batches:
            future = pool.submit(pack, batch)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()


_worker_state: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str, piece_chars: int, call_chars: int) -> None:
    """Worker-process set-up: one tokenizer per process, single-threaded (the processes are the parallelism)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    encoder = Encoder(Tokenizer.from_str(tokenizer_json), piece_chars, call_chars)
    _worker_state["pack"] = Packer(encoder, eos_id, np.dtype(dtype))


def _pack_in_worker(batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: the packed batch (arrays pickle far cheaper than id lists)."""
    return _worker_state["pack"](batch)


def _packed_in_processes(
    batches: Iterable[list[str]], num_workers: int, pack: Packer
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``pack(batch)`` of every batch, computed by ``num_workers`` spawned processes, yielded in input order;
    at most ``2 * num_workers`` batches are in flight (bounded memory)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    encoder = pack.encoder
    init = (encoder.tokenizer.to_str(), pack.eos_id, pack.dtype.name, encoder.piece_chars, encoder.call_chars)
    with context.Pool(num_workers, initializer=_init_worker, initargs=init) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_pack_in_worker, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def format_change(version: int | None) -> str:
    """Why a corpus of format ``version`` is stale: what the newer formats changed."""
    why = "; ".join(FORMAT_CHANGES[v] for v in sorted(FORMAT_CHANGES) if v > (version or 0))
    return f"it has format version {version}, this version writes {FORMAT_VERSION} ({why})"


def read_meta(prepared_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared directory (``FileNotFoundError`` if it is not one)."""
    path = Path(prepared_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{prepared_dir} is not a prepared corpus (no {META_FILE}); run `pretrain prepare`"
        )
    return json.loads(path.read_text())


def split_prefixes(prepared_dir: str | os.PathLike, split: str) -> list[Path]:
    """The ``.bin/.idx`` prefixes of ``split``, in stream order: one (``train``), or a task's each
    (``train-00000``, ...) for a corpus prepared by ``pretrain.datamodules.executors``."""
    directory = Path(prepared_dir)
    shards = read_meta(directory).get("shards") if (directory / META_FILE).is_file() else None
    return [directory / f"{split}-{s}" for s in shards] if shards else [directory / split]


def shard_tokens(prepared_dir: str | os.PathLike, split: str) -> list[np.ndarray]:
    """The (memory-mapped) token arrays of ``split``'s shards (``split_prefixes``), in stream order."""
    return [IndexedDataset(p).tokens for p in split_prefixes(prepared_dir, split)]


def shard_documents(prepared_dir: str | os.PathLike, split: str) -> list[DocumentStarts]:
    """Where the documents of ``split``'s shards start (``DocumentStarts`` over each shard's index)."""
    from pretrain.datamodules.dataset import DocumentStarts

    return [DocumentStarts(p) for p in split_prefixes(prepared_dir, split)]


def _complete(directory: Path, meta: dict) -> bool:
    """Every file present, and each split's ``.bin`` files exactly as long as the token counts ``meta`` records."""
    if not (directory / "tokenizer.json").is_file():
        return False
    itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
    splits = meta.get("splits", {})
    for s in SPLITS:
        prefixes = split_prefixes(directory, s)
        paths = [Path(f"{p}{ext}") for p in prefixes for ext in (".bin", ".idx")]
        if not all(p.is_file() for p in paths):
            return False
        size = sum(Path(f"{p}.bin").stat().st_size for p in prefixes)
        if size != splits.get(s, {}).get("tokens", -1) * itemsize:
            return False
    return True


def _remove_leftovers(out_dir: Path) -> None:
    """Temporary and old directories that killed runs of ``prepare`` left next to ``out_dir``."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@dataclass
class Plan:
    """What a build needs, computed before any document is read: the tokenizer and its EOS, the resolved
    inputs with their content hashes, the settings, and the cache key that names the result."""

    tokenizer: Tokenizer
    eos: str
    eos_id: int
    dtype: np.dtype
    sources: list[Source]
    inputs: list[dict]
    settings: dict
    cache_key: str

    @property
    def tokenizer_hash(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def key_for(self, input_hashes: list[str]) -> str:
        """The cache key of this plan's settings and tokenizer on inputs with these content hashes."""
        material = {
            "format_version": FORMAT_VERSION,
            "inputs": input_hashes,
            "tokenizer": self.tokenizer_hash,
            "settings": self.settings,
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def stale_reason(self, old: dict) -> str | None:
        """Why a directory whose ``meta.json`` is ``old`` is not this plan's output (None: it is)."""
        if old.get("cache_key") == self.cache_key:
            return None
        previous = {i["location"]: i["sha256"] for i in old.get("inputs", [])}
        changed = [
            i["location"]
            for i in self.inputs
            if i["location"] in previous and previous[i["location"]] != i["sha256"]
        ]
        if changed:
            return f"input file(s) changed since it was prepared (content hash differs): {changed}"
        if [i["location"] for i in self.inputs] != [i["location"] for i in old.get("inputs", [])]:
            return "the list of inputs differs"
        if old.get("tokenizer_sha256") != self.tokenizer_hash:
            return "the tokenizer differs"
        if old.get("format_version") != FORMAT_VERSION:
            return format_change(old.get("format_version"))
        return f"the settings differ ({old.get('settings')} -> {self.settings})"


def _input_info(source: Source, previous: dict[str, dict], hash_inputs: bool = True) -> dict:
    """Kind, location, content hash and (size, mtime) of an input; the hash recorded in ``previous`` is reused
    while the file's size and modification time are unchanged (None when not ``hash_inputs``)."""
    stat = source.stat()
    old = previous.get(source.location)
    if old is not None and stat is not None and old.get("stat") == list(stat):
        digest = old["sha256"]
    else:
        digest = source.fingerprint() if hash_inputs else None
    return {"kind": source.kind, "location": source.location, "sha256": digest, "stat": stat and list(stat)}


def plan(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer: str | os.PathLike | Tokenizer,
    *,
    val_fraction: float = 0.01,
    seed: int = 0,
    document: str = "blank_line",
    text_field: str = "text",
    split: str = "train",
    on_invalid_utf8: str = "error",
    eos_token: str | None = None,
    dedup: str = "none",
    previous: dict | None = None,
    hash_inputs: bool = True,
) -> Plan:
    """Check the arguments (one ``ValueError`` naming the fix) and compute the build's ``Plan``; ``previous`` is
    an existing ``meta.json`` whose input hashes may be reused (see ``_input_info``). Without ``hash_inputs``
    (the tasks of ``pretrain.datamodules.executors`` hash their own files) unknown hashes stay None."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1)")
    document_mode(document)  # ValueError naming the conventions
    if on_invalid_utf8 not in INVALID_UTF8_POLICIES:
        raise ValueError(f"on_invalid_utf8={on_invalid_utf8!r}; choose one of {INVALID_UTF8_POLICIES}")
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup={dedup!r}; choose one of {DEDUP_MODES}")
    tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    eos, eos_id = resolve_eos(tokenizer, eos_token)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    sources = resolve_sources(inputs, split)
    local = [s for s in sources if s.kind != "hf_hub"]
    if local and len(local) == len(sources) and all(s.size == 0 for s in local):
        raise InputError(
            f"the corpus is empty: every input is an empty file ({[s.location for s in sources]})"
        )
    recorded = {i["location"]: i for i in (previous or {}).get("inputs", [])}
    input_info = [_input_info(s, recorded, hash_inputs) for s in sources]
    settings = {
        "val_fraction": val_fraction,
        "seed": seed,
        "document": document,
        "text_field": text_field,
        "split": split,
        "on_invalid_utf8": on_invalid_utf8,
        "eos_token": eos,
        "dedup": dedup,
    }
    made = Plan(tokenizer, eos, eos_id, dtype, sources, input_info, settings, "")
    made.cache_key = made.key_for([i["sha256"] for i in input_info])
    return made


def stale_reason(prepared_dir: str | os.PathLike, inputs, tokenizer, **settings) -> str | None:
    """Why ``prepared_dir`` is not what ``prepare(inputs, tokenizer, prepared_dir, **settings)`` would write now
    (inputs edited, other tokenizer or settings, damaged files), or None when it is."""
    old = read_meta(prepared_dir)
    reason = plan(inputs, tokenizer, previous=old, **settings).stale_reason(old)
    if reason is None and not _complete(Path(prepared_dir), old):
        return "its files are missing or truncated"
    return reason


def documents_with_keys(
    sources: Sequence[Source], positions: Sequence[tuple[int, int]], settings: dict, stats: CorpusStats
) -> Iterator[tuple[int, int, str]]:
    """``(file ordinal, document ordinal in the file, text)`` of every non-blank document of ``sources``;
    ``positions[k]`` is ``(file ordinal, ordinal of its first document)`` of ``sources[k]``."""
    kwargs = {k: settings[k] for k in ("document", "text_field", "on_invalid_utf8")}
    for source, (f, first) in zip(sources, positions, strict=True):
        for i, doc in enumerate(iter_documents([source], stats=stats, **kwargs), first):
            yield f, i, doc


def _batches(
    keyed: Iterable[tuple[int, int, str]],
    keys: collections.deque,
    max_docs: int,
    max_chars: int,
    dedup: bool,
    counts: dict,
) -> Iterator[list[str]]:
    """Batches of texts (at most ``max_docs`` documents or about ``max_chars`` characters); each batch's
    ``(files, ordinals)`` arrays go to ``keys`` as it is yielded. ``dedup`` drops repeated texts."""
    seen: set[bytes] = set()
    texts: list[str] = []
    files: list[int] = []
    ordinals: list[int] = []
    chars = 0
    for f, i, doc in keyed:
        if dedup:
            digest = text_digest(doc)
            if digest in seen:
                counts["duplicates"] += 1
                continue
            seen.add(digest)
        texts.append(doc)
        files.append(f)
        ordinals.append(i)
        chars += len(doc)
        if len(texts) >= max_docs or chars >= max_chars:
            keys.append((np.array(files), np.array(ordinals)))
            yield texts
            texts, files, ordinals, chars = [], [], [], 0
    if texts:
        keys.append((np.array(files), np.array(ordinals)))
        yield texts


def build_shard(
    directory: Path,
    suffix: str,
    plan_: Plan,
    sources: Sequence[Source],
    positions: Sequence[tuple[int, int]] | None = None,
    *,
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    num_workers: int = 0,
    piece_chars: int = PIECE_CHARS,
    progress: bool = False,
    skip: set[tuple[int, int]] | None = None,
) -> tuple[dict, CorpusStats, int]:
    """Tokenize ``sources`` into ``train{suffix}`` and ``val{suffix}`` in ``directory``: returns the split
    counts, the reading counters and the number of exact duplicates dropped. ``positions``: see
    ``documents_with_keys`` (default: files ``0, 1, ...`` of the plan, read whole). ``skip``: the
    ``(file, ordinal)`` positions to drop, when duplicates were found across tasks (then no other is dropped)."""
    stats = CorpusStats()
    counts = {"duplicates": 0}
    positions = positions if positions is not None else [(f, 0) for f in range(len(sources))]
    keyed = documents_with_keys(sources, positions, plan_.settings, stats)
    if skip:
        keyed = _skipping(keyed, skip, counts)
    keys: collections.deque = collections.deque()
    dedup = plan_.settings["dedup"] == "exact" and skip is None
    batches = _batches(keyed, keys, batch_docs, batch_chars, dedup, counts)
    pack = Packer(Encoder(plan_.tokenizer, piece_chars, batch_chars), plan_.eos_id, np.dtype(plan_.dtype))
    if num_workers > 0:
        packed = _packed_in_processes(batches, num_workers, pack)
    else:
        packed = _packed_ahead(batches, pack)
    total = sum(s.size for s in sources) or None
    seed, fraction = plan_.settings["seed"], plan_.settings["val_fraction"]
    with (
        IndexedWriter(directory / f"train{suffix}", plan_.dtype) as train,
        IndexedWriter(directory / f"val{suffix}", plan_.dtype) as val,
        tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar,
    ):
        for tokens, lengths in packed:
            files, ordinals = keys.popleft()
            is_val = val_mask(ordinals, seed, fraction, files)
            token_is_val = np.repeat(is_val, lengths)
            train.add_documents(tokens[~token_is_val], lengths[~is_val])
            val.add_documents(tokens[token_is_val], lengths[is_val])
            bar.update(stats.bytes_read - bar.n)
        splits = {
            name: {"documents": w.num_documents, "tokens": w.num_tokens}
            for name, w in zip(SPLITS, (train, val))
        }
    return splits, stats, counts["duplicates"]


def _skipping(keyed, skip: set[tuple[int, int]], counts: dict):
    for f, i, doc in keyed:
        if (f, i) in skip:
            counts["duplicates"] += 1
        else:
            yield f, i, doc


def corpus_meta(plan_: Plan, splits: dict, stats: CorpusStats, duplicates: int, notes: list[str]) -> dict:
    """The ``meta.json`` of a finished build."""
    return {
        "format": "megatron-mmidx",
        "format_version": FORMAT_VERSION,
        "document_lengths": "index",  # the .idx sequences are the documents (EOS included): data.document_mask
        "dtype": np.dtype(plan_.dtype).name,
        "vocab_size": plan_.tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_token": plan_.eos,
        "eos_id": plan_.eos_id,
        "splits": splits,
        "documents": stats.documents,
        "duplicates_dropped": duplicates,
        "skipped_empty_documents": stats.skipped_empty,
        "null_texts": stats.null_texts,
        "invalid_utf8_lines": stats.invalid_utf8_lines,
        "bytes_read": stats.bytes_read,
        "warnings": notes,
        "cache_key": plan_.cache_key,
        "tokenizer_sha256": plan_.tokenizer_hash,
        "inputs": plan_.inputs,
        "settings": plan_.settings,
    }


def build_notes(plan_: Plan, splits: dict, stats: CorpusStats) -> list[str]:
    """The warnings of a finished build; ``ValueError`` when it holds no document at all."""
    if stats.documents == 0:
        raise InputError(
            f"the corpus is empty: no non-blank documents in {[s.location for s in plan_.sources]} "
            f"({stats.skipped_empty} blank documents, {stats.null_texts} null texts skipped); check the inputs, "
            f"text_field and document mode"
        )
    notes = stats.warnings(plan_.settings["on_invalid_utf8"])
    fraction = plan_.settings["val_fraction"]
    if fraction > 0 and splits["val"]["documents"] == 0:
        notes.append(f"val_fraction={fraction} selected no document; the val split is empty")
    return notes


def reuse_or_clear(out_dir: Path, plan_: Plan, force: bool) -> dict | None:
    """The existing ``meta.json`` when ``out_dir`` already holds this plan's complete output (and not
    ``force``); else None, after warning why it is rebuilt. ``ValueError`` for a foreign directory."""
    if not out_dir.exists():
        return None
    if not (out_dir / META_FILE).is_file():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
            return None
        raise InputError(f"{out_dir} exists and is not a prepared corpus; choose another out_dir")
    old = read_meta(out_dir)
    complete = _complete(out_dir, old)
    reason = plan_.stale_reason(old)
    if reason is None and complete and not force:
        return old
    if reason is not None:
        warnings.warn(f"prepared corpus {out_dir} is stale: {reason}; rebuilding it", stacklevel=3)
    elif not complete:
        warnings.warn(
            f"prepared corpus {out_dir} is damaged (missing or truncated files); rebuilding it", stacklevel=3
        )
    return None


def previous_meta(out_dir: Path) -> dict | None:
    try:
        return read_meta(out_dir)
    except (FileNotFoundError, ValueError):
        return None


def prepare(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer: str | os.PathLike | Tokenizer,
    out_dir: str | os.PathLike,
    *,
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    num_workers: int = 0,
    piece_chars: int = PIECE_CHARS,
    progress: bool = True,
    force: bool = False,
    **settings: Unpack[CorpusSettings],
) -> dict:
    """Tokenize ``inputs`` into ``out_dir`` (see module doc) and return its ``meta.json`` contents.

    ``tokenizer``: a path for ``load_tokenizer`` or a ``tokenizers.Tokenizer``. ``settings`` (``plan``'s
    keywords): ``eos_token`` is appended to every document (default ``</s>``, else ``<|endoftext|>``);
    ``document``/``text_field``/``split``/``on_invalid_utf8``: how documents are read
    (``pretrain.datamodules.corpus``); ``dedup``: ``"exact"`` drops repeated documents;
    ``val_fraction``/``seed``: the validation split. ``batch_docs``/``batch_chars`` bound one tokenization
    batch, ``piece_chars`` one piece of a long document, hence peak memory. ``num_workers``: tokenizing processes (0: this process, with the encoder's
    threads); the output does not depend on it. ``force`` rebuilds even when the cache is valid.
    The returned dict also says ``cache_hit`` (True when the existing directory was reused as is).
    """
    if batch_docs < 1 or batch_chars < 1 or piece_chars < 1:
        raise ValueError(
            f"batch_docs={batch_docs}, batch_chars={batch_chars} and piece_chars={piece_chars} must be positive"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0 (0 tokenizes in this process)")
    out_dir = Path(out_dir).expanduser()
    with exclusive(out_dir, "`pretrain prepare`"):
        plan_ = plan(inputs, tokenizer, previous=previous_meta(out_dir), **settings)
        old = reuse_or_clear(out_dir, plan_, force)
        if old is not None:
            return {**old, "cache_hit": True}
        _remove_leftovers(out_dir)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            splits, stats, duplicates = build_shard(
                tmp,
                "",
                plan_,
                plan_.sources,
                batch_docs=batch_docs,
                batch_chars=batch_chars,
                num_workers=num_workers,
                piece_chars=piece_chars,
                progress=progress,
            )
            notes = build_notes(plan_, splits, stats)
            for note in notes:
                warnings.warn(note, stacklevel=2)
            meta = corpus_meta(plan_, splits, stats, duplicates, notes)
            atomic_write_text(tmp / "tokenizer.json", plan_.tokenizer.to_str())
            atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2))
            replace_path(tmp, out_dir)
            # the tasks of a killed `prepare --executor` for this directory: the output they were to make is
            # built (a later --executor run of these settings reuses it), nothing can assemble them any more
            for staging in out_dir.parent.glob(f".{out_dir.name}.tasks-*"):
                shutil.rmtree(staging, ignore_errors=True)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise naming(err, tmp) from err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {**meta, "cache_hit": False}
