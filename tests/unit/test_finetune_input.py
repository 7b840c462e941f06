"""Finetuning input that used to train a wrong model or fail mid-run (issue 22): refused while the parts are
built, before any training, with one line naming the fix."""

from __future__ import annotations

import pytest

from pretrain.finetuning.config import validate
from pretrain.finetuning.run import build_parts

TINY_BERT = {
    "arch": "encoder",
    "vocab_size": 400,
    "d_model": 16,
    "n_layer": 1,
    "n_head": 2,
    "d_ff": 32,
    "max_seq_len": 32,
    "type_vocab_size": 2,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pretrain.datamodules.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("ft-input")
    (root / "corpus.txt").write_text("a good film, a bad plot, quite dull, really lovely\n" * 50)
    train_bpe(root / "corpus.txt", 400, root / "tokenizer.json", show_progress=False)
    return root / "tokenizer.json"


def parts(tmp_path, tokenizer, train: str, name: str = "train.tsv", **data):
    path = tmp_path / name
    path.write_text(train)
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "init": {"model": TINY_BERT, "tokenizer": str(tokenizer)},
        "data": {
            "train_file": str(path),
            "text_columns": ["sentence"],
            "label_column": "label",
            "max_length": 32,
            **data,
        },
        "trainer": {"accelerator": "cpu", "progress_bar": False},
    }
    return build_parts(validate(cfg))


TWO_CLASSES = "sentence\tlabel\na good film\t1\na bad plot\t0\n"


def test_a_train_file_with_one_class_is_refused(tmp_path, tokenizer):
    with pytest.raises(
        ValueError, match="every example has label '1'; a classifier needs two or more classes"
    ):
        parts(tmp_path, tokenizer, "sentence\tlabel\na good film\t1\nlovely\t1\n")
    assert parts(tmp_path, tokenizer, TWO_CLASSES).datamodule.num_labels == 2


def test_max_length_below_the_templates_special_tokens_is_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="max_length=2 leaves no room for text: the template adds 2 special"):
        parts(tmp_path, tokenizer, TWO_CLASSES, max_length=2)
    encoded = parts(tmp_path, tokenizer, TWO_CLASSES, max_length=3).datamodule.examples["train"]
    assert max(len(ids) for ids, _, _ in encoded) == 3  # truncation on: [CLS] one token [SEP]


def test_max_length_beyond_the_backbones_positions_is_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="data.max_length=64 exceeds the backbone's 32 positions"):
        parts(tmp_path, tokenizer, TWO_CLASSES, max_length=64)


def test_a_csv_file_is_read_as_comma_separated(tmp_path, tokenizer):
    csv = 'sentence,label\n"a good film, really",1\na bad plot,0\n'
    datamodule = parts(tmp_path, tokenizer, csv, name="train.csv").datamodule
    assert datamodule.label_names == ["0", "1"] and len(datamodule.examples["train"]) == 2


def test_an_empty_file_says_it_is_empty(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"train.tsv is empty; give a file with a header row"):
        parts(tmp_path, tokenizer, "")
