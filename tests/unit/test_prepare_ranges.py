"""Byte ranges of one input file (``corpus.document_start``, ``executors.task_pieces``): read range by range, a file
gives the documents and counters of the file read whole, for every convention that allows ranges."""

from __future__ import annotations

import itertools
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pretrain.datamodules.corpus import CorpusStats, Source, document_start, iter_documents
from pretrain.datamodules.executors import Piece, task_pieces

# lines that stress the conventions: blank, whitespace-only (Unicode too), CRLF, invalid UTF-8, JSON-ish
LINES = st.sampled_from(
    [
        b"",
        b"  ",
        b"\t",
        "\u3000".encode(),
        b"\r",
        b"word",
        b"two words",
        "caf\u00e9".encode(),
        b"x\r",
        b"\xff\xfe",
        b"a",
    ]
)


def read(source: Source, document: str, policy: str) -> tuple[list[str], CorpusStats]:
    stats = CorpusStats()
    docs = list(iter_documents([source], document=document, on_invalid_utf8=policy, stats=stats))
    return docs, stats


def counters(stats: CorpusStats) -> tuple:
    return stats.documents, stats.skipped_empty, stats.invalid_utf8_lines, stats.bytes_read, stats.null_texts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(LINES, min_size=1, max_size=40),
    final_newline=st.booleans(),
    offsets=st.lists(st.integers(1, 400), max_size=4),
    document=st.sampled_from(["line", "blank_line"]),
    policy=st.sampled_from(["replace", "skip"]),
)
def test_text_ranges_cut_at_document_starts_read_as_the_whole_file(
    tmp_path, lines, final_newline, offsets, document, policy
):
    path = tmp_path / "c.txt"
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    path.write_bytes(data)
    whole = Source("text", str(path))
    cuts = sorted({c for o in offsets if (c := document_start(whole, o, document)) is not None})
    assert all(0 < c < len(data) and data[c - 1 : c] == b"\n" for c in cuts)  # line starts inside the file
    bounds = [0, *cuts, None]
    docs, stats = [], CorpusStats()
    for start, end in itertools.pairwise(bounds):
        part, part_stats = read(Source("text", str(path), start=start, end=end), document, policy)
        docs += part
        for k in ("documents", "skipped_empty", "invalid_utf8_lines", "bytes_read", "null_texts"):
            setattr(stats, k, getattr(stats, k) + getattr(part_stats, k))
    expected, expected_stats = read(whole, document, policy)
    assert docs == expected
    assert counters(stats) == counters(expected_stats)


def test_jsonl_ranges_and_unsplittable_inputs(tmp_path):
    records = [{"text": f"record {i}" if i % 7 else ""} for i in range(200)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    whole = Source("jsonl", str(path))
    cut = document_start(whole, path.stat().st_size // 2, "blank_line")  # JSONL: any line start
    assert cut is not None and path.read_bytes()[cut - 1 : cut] == b"\n"
    first, _ = read(Source("jsonl", str(path), end=cut), "blank_line", "error")
    second, _ = read(Source("jsonl", str(path), start=cut), "blank_line", "error")
    assert first + second == read(whole, "blank_line", "error")[0]
    # `file` convention, separators and gzipped inputs are read whole
    text = tmp_path / "c.txt"
    text.write_text("a\n\nb\n" * 100)
    for document in ("file", "separator:S", "heading:= x ="):
        assert document_start(Source("text", str(text)), 50, document) is None
    gz = tmp_path / "c.txt.gz"
    gz.write_bytes(b"")
    assert document_start(Source("text", str(gz)), 1, "line") is None


def test_task_pieces_cut_large_files_at_document_starts_and_others_at_file_ends():
    # files smaller than a task's share stay whole, each given to the task holding its middle
    assert task_pieces([10, 10, 10, 10], 2) == [[Piece(0), Piece(1)], [Piece(2), Piece(3)]]
    assert task_pieces([100, 1, 1], 2, lambda f, o: None) == [[Piece(0)], [Piece(1), Piece(2)]]
    # a file larger than the share is cut at the document start cut_at finds (here: the next multiple of 7)
    runs = task_pieces([100, 1, 1], 3, lambda f, o: -(-o // 7) * 7)
    assert runs == [[Piece(0, 0, 35)], [Piece(0, 35, 70)], [Piece(0, 70, None), Piece(1), Piece(2)]]
    # two cuts moved to the same document start leave that task empty, not holding an empty piece
    assert task_pieces([100], 3, lambda f, o: 50) == [[Piece(0, 0, 50)], [], [Piece(0, 50, None)]]
    # more tasks than documents: cut_at finds no start, later tasks are empty; every byte in exactly one piece
    runs = task_pieces([5, 1, 7, 3, 9], 8, lambda f, o: None)
    assert len(runs) == 8 and [p.file for run in runs for p in run] == [0, 1, 2, 3, 4]
    assert all(p.start == 0 and p.end is None for run in runs for p in run)
