"""Reading raw corpora as a stream of documents, with bounded memory.

Inputs (``resolve_sources``): plain-text files (any suffix not below, optionally ``.gz``), JSON Lines
(``.jsonl``/``.json``, one record per line, text in ``text_field``), Parquet (``.parquet``, column
``text_field``), a directory (its files of those kinds, sorted; or a ``datasets.save_to_disk`` directory),
a glob pattern, or a Hugging Face ``datasets`` name (``"name"`` or ``"name:config"``, read with
``datasets.load_dataset``).

Documents (the *document convention* of a source, set per source in a recipe: ``data.sources[].document``,
``.text_field``): a JSONL record's ``text_field``, a Parquet row or a dataset row is one document, its
paragraph breaks kept. Plain text is split by ``document``:

    ``"file"``        the whole file is one document (paragraph breaks kept)
    ``"line"``        each line is a document
    ``"blank_line"``  each paragraph (runs of lines separated by empty or whitespace-only lines; the lines
                      joined with ``"\\n"``) is a document: the paragraph break itself is *not* kept -- after
                      ``prepare`` each one becomes EOS, so a model never sees a blank line
    ``"separator:S"`` documents end at lines equal to ``S`` (e.g. ``separator:<|endoftext|>``); everything
                      between, blank lines included, is kept: paragraph breaks inside documents survive
    ``"heading:R"``   documents start at lines matching the regular expression ``R`` (whole line, surrounding
                      whitespace ignored), which stay as their first line; blank lines kept (WikiText
                      articles: ``heading:= [^=].* =``, top-level ``= Title =`` lines)

Leading and trailing blank lines of a document are trimmed; whitespace-only documents are skipped and
counted.

Byte ranges: a ``Source`` with ``start``/``end`` reads only the documents that start in ``[start, end)`` of an
uncompressed text (``line``/``blank_line``) or JSONL file, when both ends are document starts
(``document_start``); the documents of consecutive ranges are, in order, those of the whole file. Other
conventions (``file``, ``separator:S``, ``heading:R``), Parquet and gzipped files are read whole.

Invalid UTF-8 (``on_invalid_utf8``): ``"error"`` raises ``ValueError`` naming file and line;
``"replace"`` decodes the line with U+FFFD; ``"skip"`` drops the line (JSONL: the record). Both are
counted in ``CorpusStats`` and reported with the first location.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.compat import hub
from pretrain.errors import InputError

DOCUMENT_MODES = ("line", "blank_line", "file")  # and "separator:S" / "heading:R", naming a line or pattern
INVALID_UTF8_POLICIES = ("error", "replace", "skip")


class InvalidUTF8Error(ValueError):
    """A line that is not UTF-8 under ``on_invalid_utf8="error"``; ``with_fix(key)`` names the setting to change."""

    def __init__(self, location: str, detail: str):
        self.location, self.detail = location, detail
        super().__init__(self.with_fix("on_invalid_utf8"))

    def __reduce__(self):  # picklable (a task of ``pretrain.datamodules.executors`` sends it to the launcher)
        return type(self), (self.location, self.detail)

    def with_fix(self, key: str) -> str:
        return f"{self.location}: invalid UTF-8 ({self.detail}); fix the file or set {key}=replace (or skip)"


_JSONL = (".jsonl", ".json")
_PARQUET = (".parquet",)
_TEXT = (".txt", ".text", ".raw", ".tokens", ".en", ".de", ".md")
_BLOCK = 1 << 20  # bytes read per block from text/JSONL files (larger blocks fragment the heap)
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")


@dataclass(frozen=True)
class Source:
    """One input: ``kind`` in {"text", "jsonl", "parquet", "hf_disk", "hf_hub"}, its path or name, and
    the split read from a ``datasets`` dataset; ``start``/``end`` (bytes, ``end=None``: the file's end) and
    ``first_line`` (the line number at ``start``, for messages) select a byte range of a splittable file."""

    kind: str
    location: str
    split: str = "train"
    start: int = 0
    end: int | None = None
    first_line: int = 1

    @property
    def size(self) -> int:
        """Bytes on disk, of the range when it has one (0 for a hub dataset, unknown before download)."""
        if self.kind == "hf_hub":
            return 0
        path = Path(self.location)
        if path.is_file():
            end = path.stat().st_size if self.end is None else self.end
            return end - self.start
        return sum(p.stat().st_size for p in _files_under(path))

    def stat(self) -> tuple[int, int] | None:
        """``(bytes, newest modification time in ns)`` of the file(s) on disk; None for a hub dataset."""
        if self.kind == "hf_hub":
            return None
        path = Path(self.location)
        files = [path] if path.is_file() else _files_under(path)
        stats = [f.stat() for f in files]
        return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)

    def fingerprint(self) -> str:
        """Content hash: sha256 of the file bytes (all files of a ``save_to_disk`` dir); for a hub
        dataset, the fingerprint ``datasets`` computed for the downloaded data."""
        if self.kind == "hf_hub":
            return hub.fingerprint(_load_hub(self.location, self.split))
        path = Path(self.location)
        digest = hashlib.sha256()
        for file in [path] if path.is_file() else _files_under(path):
            digest.update(str(file.relative_to(path)).encode() if file != path else b"")
            with open(file, "rb") as f:
                while chunk := f.read(_BLOCK):
                    digest.update(chunk)
        return digest.hexdigest()


@dataclass
class CorpusStats:
    """Counters filled while reading (``bytes_read`` drives progress bars)."""

    documents: int = 0
    skipped_empty: int = 0
    invalid_utf8_lines: int = 0
    first_invalid_utf8: str | None = None
    empty_sources: list[str] = field(default_factory=list)
    bytes_read: int = 0
    null_texts: int = 0  # records / rows whose text is null (skipped)
    first_null_text: str | None = None

    def warnings(self, on_invalid_utf8: str) -> list[str]:
        out = []
        if self.invalid_utf8_lines:
            action = "replaced with U+FFFD" if on_invalid_utf8 == "replace" else "skipped"
            out.append(
                f"{self.invalid_utf8_lines} line(s) of invalid UTF-8 {action} "
                f"(first at {self.first_invalid_utf8}; on_invalid_utf8={on_invalid_utf8!r})"
            )
        if self.null_texts:
            out.append(
                f"{self.null_texts} record(s) with a null text skipped (first in {self.first_null_text})"
            )
        if self.empty_sources:
            out.append(
                f"{len(self.empty_sources)} empty input(s) ignored: {', '.join(self.empty_sources[:5])}"
            )
        return out


def _kind_of(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    last = suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else (suffixes or [""])[-1]
    if last in _JSONL:
        return "jsonl"
    if last in _PARQUET:
        return "parquet"
    return "text"


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))


def _is_saved_dataset(directory: Path) -> bool:
    return (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file()


def _load_hub(location: str, split: str):
    import datasets

    name, _, config = location.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except Exception as err:  # offline, unknown name, bad config: all mean "cannot read this input"
        raise FileNotFoundError(
            f"{location!r} is not an existing path, and loading it as a `datasets` name failed: {err}"
        ) from err


class MissingInput(FileNotFoundError):
    """A corpus input (a path or a pattern) that names no file: the caller says which recipe key listed it."""


def resolve_sources(
    inputs: str | os.PathLike | Iterable[str | os.PathLike], split: str = "train"
) -> list[Source]:
    """Expand ``inputs`` into sources, checking that each local one exists (no data is read);
    ``split`` is the split taken from ``datasets`` inputs."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise InputError(
            "no corpus inputs given; pass text/JSONL/Parquet files, directories or dataset names"
        )
    sources: list[Source] = []
    for item in items:
        text = str(item)
        path = Path(text).expanduser()
        if any(ch in text for ch in "*?["):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise MissingInput(f"the pattern {text!r} matches no files")
            sources += [Source(_kind_of(Path(m)), m) for m in matches if Path(m).is_file()]
        elif path.is_file():
            sources.append(Source(_kind_of(path), str(path)))
        elif path.is_dir():
            if _is_saved_dataset(path):
                sources.append(Source("hf_disk", str(path), split))
            else:
                files = _files_under(path)
                if not files:
                    raise InputError(f"the directory {path} contains no files")
                sources += [Source(_kind_of(f), str(f)) for f in files]
        elif _HUB_NAME.match(text) and _kind_of(path) == "text" and not path.suffix:
            sources.append(Source("hf_hub", text, split))
        else:
            raise MissingInput(f"corpus input {text!r} does not exist (check the path)")
    return sources


def _decode_block(
    data: bytes, where: str, first_line: int, policy: str, stats: CorpusStats, keep_line_numbers: bool
) -> str:
    """``data`` (whole lines) as text; invalid UTF-8 handled line by line per ``policy``. A skipped line
    is removed, or left empty when ``keep_line_numbers`` (so later lines keep their numbers)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    lines = []
    for i, raw in enumerate(data.split(b"\n")):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            location = f"{where}:{first_line + i}"
            if policy == "error":
                raise InvalidUTF8Error(location, f"{err.reason} at byte {err.start} of the line") from None
            stats.invalid_utf8_lines += 1
            stats.first_invalid_utf8 = stats.first_invalid_utf8 or location
            if policy == "replace":
                lines.append(raw.decode("utf-8", errors="replace"))
            elif keep_line_numbers:
                lines.append("")
    return "\n".join(lines)


def splittable(source: Source, document: str) -> bool:
    """Whether ``source`` can be read in byte ranges (see the module doc)."""
    if source.location.endswith(".gz") or not Path(source.location).is_file():
        return False
    return source.kind == "jsonl" or (source.kind == "text" and document in ("line", "blank_line"))


def _is_blank(line: bytes) -> bool:
    try:
        return line.decode("utf-8").isspace() or not line
    except UnicodeDecodeError:
        return False


def _is_text(line: bytes) -> bool:
    try:
        return not line.decode("utf-8").isspace() and bool(line)
    except UnicodeDecodeError:
        return False


def document_start(source: Source, offset: int, document: str) -> int | None:
    """The first byte offset ``>= offset`` (and > 0) of the file ``source`` where a document starts such that
    reading the file in ranges cut there gives its documents unchanged; None if there is none before the end
    or the file is not ``splittable``. ``line`` and JSONL: a line start. ``blank_line``: the start of a
    (valid UTF-8, non-whitespace) line that follows a whitespace-only line. Reads from ``offset`` only as far
    as needed."""
    if not splittable(source, document):
        return None
    blank_line = source.kind == "text" and document == "blank_line"
    with open(source.location, "rb") as f:
        f.seek(max(offset - 1, 0))
        if offset > 0:
            _skip_line(
                f, b""
            )  # the rest of the line holding offset - 1: the next line starts at or after offset
        previous_blank = False
        while True:
            start = f.tell()
            head = f.readline(_HEAD)  # a line's first bytes decide (bounded memory for long lines)
            if not head:
                return None
            if start > 0 and (not blank_line or (previous_blank and _is_text(head.rstrip(b"\n")))):
                return start
            previous_blank = head.endswith(b"\n") and _is_blank(head[:-1])
            _skip_line(f, head)


_HEAD = 1 << 16


def _skip_line(f, head: bytes) -> None:
    """Read on to the start of the next line (``head``: what was read of this one)."""
    while not head.endswith(b"\n") and (head := f.readline(_HEAD)):
        pass


def _iter_text_blocks(
    path: str,
    policy: str,
    stats: CorpusStats,
    keep_line_numbers: bool = False,
    span: tuple[int, int | None, int] = (0, None, 1),
) -> Iterator[tuple[str, int]]:
    """A (possibly gzipped) file, or the byte range ``span = (start, end, first line number)`` of a plain one,
    as decoded blocks of whole lines (each but the last ends with a newline), with the number of each
    block's first line; ``stats.bytes_read`` advances by bytes consumed on disk."""
    start, end, line_no = span
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        if start:
            raw.seek(start)
        rest, consumed = b"", start
        while True:
            want = _BLOCK if end is None else min(_BLOCK, end - consumed)
            try:
                block = f.read(want) if want > 0 else b""
            except (EOFError, gzip.BadGzipFile, zlib.error) as err:
                raise InputError(
                    f"{path}: truncated or corrupt gzip file ({err}); download or compress it again"
                ) from None
            stats.bytes_read += raw.tell() - consumed
            consumed = raw.tell()
            data = rest + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut == 0 and block:  # a line longer than the block: keep reading
                rest = data
                continue
            data, rest = data[:cut], data[cut:]
            if data:
                yield _decode_block(data, path, line_no, policy, stats, keep_line_numbers), line_no
                line_no += data.count(b"\n")
            if not block:
                return


# A paragraph ends at a newline followed by whitespace-only lines; leading/trailing blank lines are trimmed.
_PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+")
_LEADING_BLANK = re.compile(r"\A(?:[^\S\n]*\n)+")
_TRAILING_BLANK = re.compile(r"(?:\n[^\S\n]*)+\Z")


def document_mode(document: str) -> tuple[str, str | None]:
    """``document`` -> ``(mode, separator)``; ValueError naming the conventions when it is not one."""
    mode, colon, separator = document.partition(":")
    if colon and mode in ("separator", "heading") and separator.strip():
        if mode == "heading":
            try:
                re.compile(separator.strip())
            except re.error as err:
                raise InputError(
                    f"document={document!r}: heading is not a regular expression ({err})"
                ) from None
        return mode, separator.strip()
    if not colon and mode in DOCUMENT_MODES:
        return mode, None
    raise InputError(
        f"document={document!r}; choose one of file, line, blank_line, separator:S (S: the line that "
        "ends a document, e.g. separator:<|endoftext|>) or heading:R (R: a regular expression matching the "
        "line that starts one)"
    )


def _separated_documents(blocks: Iterable[str], separator: str, heading: bool = False) -> Iterator[str]:
    """Documents ended by lines equal to ``separator`` (surrounding whitespace ignored), or with ``heading``
    started by lines matching the regular expression ``separator`` (kept); blank lines kept."""
    lines: list[str] = []
    carry = ""
    pattern = re.compile(separator) if heading else None

    def boundary(line: str) -> bool:
        return bool(pattern.fullmatch(line.strip())) if pattern is not None else line.strip() == separator

    for text in blocks:
        *complete, carry = (carry + text).split("\n")
        for line in complete:
            if boundary(line):
                yield "\n".join(lines)
                lines = [line] if heading else []
            else:
                lines.append(line)
    if heading or not boundary(carry):
        lines.append(carry)
    yield "\n".join(lines)


def _trim_blank_lines(document: str) -> str:
    return _TRAILING_BLANK.sub("", _LEADING_BLANK.sub("", document, count=1), count=1)


def _span(source: Source) -> tuple[int, int | None, int]:
    return source.start, source.end, source.first_line


def _text_documents(source: Source, document: str, policy: str, stats: CorpusStats) -> Iterator[str]:
    mode, separator = document_mode(document)
    blocks = (text for text, _ in _iter_text_blocks(source.location, policy, stats, span=_span(source)))
    if mode in ("separator", "heading"):
        assert separator is not None  # document_mode gives these modes theirs
        yield from map(_trim_blank_lines, _separated_documents(blocks, separator, heading=mode == "heading"))
        return
    if mode == "file":
        yield "".join(blocks)
        return
    if mode == "line":
        for text in blocks:
            if not text:  # a block whose only line was invalid UTF-8, skipped: no line at all
                continue
            lines = text.split("\n")
            yield from lines[:-1] if text.endswith("\n") else lines
        return
    carry = ""
    for text in blocks:
        *paragraphs, carry = _PARAGRAPH_BREAK.split(carry + text)  # the last one may continue
        for paragraph in paragraphs:
            if paragraph := _LEADING_BLANK.sub("", paragraph, count=1):
                yield paragraph
    if carry := _trim_blank_lines(carry):
        yield carry


def _record_text(record: object, text_field: str, where: str) -> str | None:
    """The record's text; None for a null (counted as ``CorpusStats.null_texts`` and skipped, as in Parquet)."""
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise InputError(f"{where}: record has no field {text_field!r} (has {keys}); set text_field")
    value = record[text_field]
    if value is None:
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: field {text_field!r} is {type(value).__name__}, expected a string")
    return value


def _jsonl_documents(
    source: Source, text_field: str, policy: str, stats: CorpusStats
) -> Iterator[str | None]:
    path = source.location
    for text, first_line in _iter_text_blocks(
        path, policy, stats, keep_line_numbers=True, span=_span(source)
    ):
        for line_no, line in enumerate(text.split("\n"), first_line):
            if not line or line.isspace():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(
                    f"{path}:{line_no}: invalid JSON ({err.msg}); expected one object per line"
                ) from None
            yield _record_text(record, text_field, f"{path}:{line_no}")


def _column_check(columns: Iterable[str], text_field: str, where: str) -> None:
    columns = list(columns)
    if text_field not in columns:
        raise InputError(f"{where} has no column {text_field!r} (columns: {columns}); set text_field")


def _parquet_documents(path: str, text_field: str, stats: CorpusStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    _column_check(pf.schema_arrow.names, text_field, path)
    bytes_per_row = Path(path).stat().st_size / max(pf.metadata.num_rows, 1)
    for batch in pf.iter_batches(batch_size=4096, columns=[text_field]):
        stats.bytes_read += round(bytes_per_row * batch.num_rows)
        yield from batch.column(0).to_pylist()


def _dataset_documents(source: Source, text_field: str, stats: CorpusStats) -> Iterator[str]:
    import datasets

    if source.kind == "hf_disk":
        ds = datasets.load_from_disk(source.location)
        if isinstance(ds, datasets.DatasetDict):
            if source.split not in ds:
                raise InputError(
                    f"{source.location} has no split {source.split!r} (splits: {list(ds)}); set split"
                )
            ds = ds[source.split]
    else:
        ds = _load_hub(source.location, source.split)
    _column_check(ds.column_names, text_field, source.location)
    for batch in ds.select_columns([text_field]).iter(batch_size=4096):
        texts = batch[text_field]
        stats.bytes_read += sum(map(len, texts))
        yield from texts


def iter_documents(
    sources: Iterable[Source],
    *,
    document: str = "blank_line",
    text_field: str = "text",
    on_invalid_utf8: str = "error",
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """Every non-blank document of ``sources`` in order; counters go to ``stats``."""
    document_mode(document)
    if on_invalid_utf8 not in INVALID_UTF8_POLICIES:
        raise ValueError(f"on_invalid_utf8={on_invalid_utf8!r}; choose one of {INVALID_UTF8_POLICIES}")
    stats = stats if stats is not None else CorpusStats()
    for source in sources:
        if source.kind in ("text", "jsonl", "parquet") and source.size == 0:
            stats.empty_sources.append(source.location)
            continue
        docs: Iterator[str | None]
        if source.kind == "text":
            docs = _text_documents(source, document, on_invalid_utf8, stats)
        elif source.kind == "jsonl":
            docs = _jsonl_documents(source, text_field, on_invalid_utf8, stats)
        elif source.kind == "parquet":
            docs = _parquet_documents(source.location, text_field, stats)
        else:
            docs = _dataset_documents(source, text_field, stats)
        for doc in docs:
            if doc is None:
                stats.null_texts += 1
                stats.first_null_text = stats.first_null_text or source.location
            elif doc and not doc.isspace():
                stats.documents += 1
                yield doc
            else:
                stats.skipped_empty += 1


def batched(docs: Iterable[str], max_docs: int = 1024, max_chars: int = 1 << 20) -> Iterator[list[str]]:
    """Group documents into lists of at most ``max_docs`` documents or about ``max_chars`` characters."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch
