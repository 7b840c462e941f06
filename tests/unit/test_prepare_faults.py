"""Issue 22, prepare / tokenizer: wrong results that used to pass with exit 0, and faults that gave a traceback.
Each test fails on the code before the fix."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from training_utils import CORPUS, one_error_line, tiny_recipe

from pretrain.cli import main
from pretrain.datamodules.prepare import Encoder, prepare, split_pieces
from pretrain.datamodules.tokenizer import TextEncoder, load_tokenizer
from pretrain.io import exclusive


def source_recipe(tmp_path, world, *sources, **sections):
    data = {"sources": [{"name": f"s{i}", **s} for i, s in enumerate(sources)]}
    return tiny_recipe(tmp_path, world, "gpt", data=data, **sections)


def test_fit_refuses_shards_older_than_the_edited_corpus(capsys, tmp_path, tiny_world):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:30_000])
    recipe = source_recipe(tmp_path, tiny_world, {"text": [str(corpus)], "prepared": str(tmp_path / "p")})
    assert main(["prepare", str(recipe)]) == 0
    corpus.write_text(CORPUS.read_text()[:30_000].replace("the", "a"))  # edited after prepare
    line = one_error_line(capsys, "fit", recipe)
    assert "stale" in line and "c.txt" in line and "pretrain prepare" in line
    assert main(["prepare", str(recipe)]) == 0  # rebuilt: fit accepts it again (checked up to the run set-up)
    from pretrain import config
    from pretrain.training.setup import check_fresh

    run, _ = config.load(recipe)
    check_fresh(run, run.data.sources[0], load_tokenizer(tiny_world["tokenizer"]))


def test_null_texts_are_counted_and_reported_in_parquet_and_jsonl(capsys, tmp_path, tiny_world):
    rows = ["alpha beta", None, "gamma delta", None, None, "epsilon"]
    pq.write_table(pa.table({"text": rows}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    for name in ("a.parquet", "b.jsonl"):
        out = tmp_path / f"out-{name}"
        with pytest.warns(UserWarning, match=rf"3 record\(s\) with a null text skipped .*{name}"):
            meta = prepare(tmp_path / name, tiny_world["tokenizer"], out, val_fraction=0.0, progress=False)
        assert meta["null_texts"] == 3 and meta["documents"] == 3
    recipe = source_recipe(
        tmp_path, tiny_world, {"text": [str(tmp_path / "a.parquet")], "prepared": str(tmp_path / "cli")}
    )
    assert main(["prepare", str(recipe), "data.val_fraction=0"]) == 0
    assert "dropped 3 null texts" in capsys.readouterr().out


def test_two_sources_with_one_prepared_directory_are_refused(capsys, tmp_path, tiny_world):
    same = str(tmp_path / "p")
    recipe = source_recipe(
        tmp_path,
        tiny_world,
        {"text": ["a.txt"], "prepared": same},
        {"text": ["b.txt"], "prepared": same + "/."},
    )
    line = one_error_line(capsys, "prepare", recipe)
    assert "data.sources[1].prepared" in line and "data.sources[0]" in line


def test_a_second_prepare_into_the_same_directory_is_refused(capsys, tmp_path, tiny_world):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:5_000])
    recipe = source_recipe(tmp_path, tiny_world, {"text": [str(corpus)], "prepared": str(tmp_path / "p")})
    with exclusive(tmp_path / "p", "`pretrain prepare`"):  # what a concurrent `pretrain prepare` holds
        line = one_error_line(capsys, "prepare", recipe)
    assert f"another `pretrain prepare` (pid {os.getpid()} on host" in line and "is writing" in line
    assert not (tmp_path / "p").exists()
    assert main(["prepare", str(recipe)]) == 0


def test_truncated_gzip_is_one_line(capsys, tmp_path, tiny_world):
    data = gzip.compress(CORPUS.read_bytes()[:50_000])
    (tmp_path / "c.txt.gz").write_bytes(data[: len(data) // 2])
    recipe = source_recipe(
        tmp_path, tiny_world, {"text": [str(tmp_path / "c.txt.gz")], "prepared": str(tmp_path / "p")}
    )
    line = one_error_line(capsys, "prepare", recipe)
    assert "c.txt.gz: truncated or corrupt gzip" in line


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([*"ab .,'\n\t1é", "  ", " 's", "<mask>", "\u3000", "the "]), max_size=120).map(
        "".join
    ),
    st.integers(1, 40),
)
def test_long_documents_encode_in_pieces_to_the_same_ids(text, piece_chars):
    tokenizer = _tok()
    pieces = split_pieces(text, piece_chars)
    assert "".join(pieces) == text
    whole = TextEncoder(tokenizer).encode(text)  # the whole document, special-token text as text
    assert np.asarray(Encoder(tokenizer, piece_chars)([text])[0]).tolist() == whole


_TOKENIZER = []


def _tok():
    if not _TOKENIZER:
        from pretrain.datamodules.tokenizer import train_bpe

        _TOKENIZER.append(train_bpe([CORPUS], 600, show_progress=False))
    return _TOKENIZER[0]


def test_exact_dedup_drops_repeats_and_keeps_the_others_split(capsys, tmp_path, tiny_world):
    paragraphs = CORPUS.read_text()[:40_000].split("\n\n")
    text = "\n\n".join(paragraphs + paragraphs[:50] + paragraphs[10:20])  # 60 repeats, appended
    (tmp_path / "c.txt").write_text(text)
    tok = tiny_world["tokenizer"]
    plain = prepare(tmp_path / "c.txt", tok, tmp_path / "plain", val_fraction=0.3, progress=False)
    deduped = prepare(
        tmp_path / "c.txt", tok, tmp_path / "dedup", val_fraction=0.3, dedup="exact", progress=False
    )
    unique = len({p for p in paragraphs if p.strip()})
    assert deduped["duplicates_dropped"] == plain["documents"] - unique
    assert sum(s["documents"] for s in deduped["splits"].values()) == unique
    # the first occurrences are the plain build's first documents, in the same split (positions are kept)
    from pretrain.datamodules.indexed import IndexedDataset

    for split in ("train", "val"):
        kept = [d.tolist() for d in IndexedDataset(tmp_path / "dedup" / split)]
        first = [d.tolist() for d in IndexedDataset(tmp_path / "plain" / split)][: len(kept)]
        assert kept == first
    recipe = source_recipe(
        tmp_path,
        tiny_world,
        {"text": [str(tmp_path / "c.txt")], "prepared": str(tmp_path / "cli"), "dedup": "exact"},
    )
    assert main(["prepare", str(recipe)]) == 0
    assert f"dropped {deduped['duplicates_dropped']} exact duplicates" in capsys.readouterr().out
