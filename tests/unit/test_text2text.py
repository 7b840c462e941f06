"""Text-to-text data: T5's GLUE text formats, line-aligned (gzipped) parallel files, padded encoder-decoder batches."""

from __future__ import annotations

import gzip

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from pretrain.datamodules.text2text import (
    IGNORE_INDEX,
    Text2TextCollate,
    Text2TextDataModule,
    glue_pairs,
    parallel_pairs,
)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_glue_formats(tmp_path):
    sst2 = write(tmp_path / "sst2.tsv", "sentence\tlabel\nit 's a charming journey . \t1\nbleak \t0\n")
    assert glue_pairs(sst2, "SST-2") == [
        ("sst2 sentence: it 's a charming journey .", "positive"),
        ("sst2 sentence: bleak", "negative"),
    ]
    rte = write(tmp_path / "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA b.\tC d.\tnot_entailment\n")
    assert glue_pairs(rte, "rte") == [("rte sentence1: A b. sentence2: C d.", "not_entailment")]
    stsb = write(tmp_path / "stsb.tsv", "sentence1\tsentence2\tscore\nx\ty\t3.75\nx\ty\t0.1\n")
    assert [t for _, t in glue_pairs(stsb, "stsb")] == ["3.8", "0.0"]  # nearest 0.2, as T5
    cola = write(tmp_path / "cola.tsv", "gj04\t1\t\tOur friends won't buy this.\n")
    assert glue_pairs(cola, "cola") == [("cola sentence: Our friends won't buy this.", "acceptable")]


def test_glue_errors(tmp_path):
    bad_label = write(tmp_path / "sst2.tsv", "sentence\tlabel\ngood\t7\n")
    with pytest.raises(ValueError, match=r"line 2: label '7'"):
        glue_pairs(bad_label, "sst2")
    no_column = write(tmp_path / "nocol.tsv", "text\tlabel\ngood\t1\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['sentence'\]"):
        glue_pairs(no_column, "sst2")
    with pytest.raises(ValueError, match="no text-to-text format"):
        glue_pairs(no_column, "squad")
    with pytest.raises(FileNotFoundError):
        glue_pairs(tmp_path / "absent.tsv", "sst2")


def test_real_glue_and_multi30k(shared_data):
    pairs = glue_pairs(shared_data / "cls/glue/SST-2/dev.tsv", "sst2")
    assert len(pairs) == 872 and {t for _, t in pairs} == {"positive", "negative"}
    mt = shared_data / "mt/multi30k"
    val = parallel_pairs(mt / "val.de.gz", mt / "val.en.gz", "translate German to English: ")
    assert len(val) == 1014
    assert val[0] == (
        "translate German to English: Eine Gruppe von Männern lädt Baumwolle auf einen Lastwagen",
        "A group of men are loading cotton onto a truck",
    )


def test_parallel_files_must_align(tmp_path):
    with gzip.open(tmp_path / "a.de.gz", "wt", encoding="utf-8") as f:
        f.write("eins\nzwei\n")
    write(tmp_path / "a.en", "one\n")
    with pytest.raises(ValueError, match="line-aligned"):
        parallel_pairs(tmp_path / "a.de.gz", tmp_path / "a.en")
    write(tmp_path / "b.en", "one\ntwo\n")
    assert parallel_pairs(tmp_path / "a.de.gz", tmp_path / "b.en", "de-en: ") == [
        ("de-en: eins", "one"),
        ("de-en: zwei", "two"),
    ]


def test_collate_pads_and_shifts():
    batch = Text2TextCollate(pad_id=0, decoder_start_id=0)(
        [([5, 6, 1], [7, 1], "a"), ([5, 1], [8, 9, 1], "bc")]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 1], [5, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 1, IGNORE_INDEX], [8, 9, 1]]
    assert batch["decoder_input_ids"].tolist() == [[0, 7, 1], [0, 8, 9]]
    assert batch["targets"] == ["a", "bc"]


def test_datamodule_appends_eos_and_truncates():
    vocab = {"<pad>": 0, "</s>": 1, "[UNK]": 2} | {
        w: i + 3 for i, w in enumerate(["a", "b", "c", "d", "e", "f"])
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    dm = Text2TextDataModule(
        tokenizer,
        [("a b c d e", "f"), ("a", "b c")],
        [("d", "e")],
        pad_id=0,
        eos_id=1,
        decoder_start_id=0,
        max_source_length=4,
        max_target_length=4,
        micro_batch_size=2,
    )
    dm.setup()
    assert dm.examples["train"][0] == ([3, 4, 5, 1], [8, 1], "f")  # 3 tokens + EOS
    batch = next(iter(dm.val_dataloader()))
    assert torch.equal(batch["labels"], torch.tensor([[7, 1]]))
    with pytest.raises(ValueError, match="max_source_length"):
        Text2TextDataModule(tokenizer, [], pad_id=0, eos_id=1, decoder_start_id=0, max_source_length=1)
