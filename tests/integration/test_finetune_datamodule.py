"""FinetuneDataModule: GLUE layouts, BERT-style pair encoding checked against transformers, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from pretrain.datamodules.finetune import FinetuneDataModule, read_table
from pretrain.datamodules.special_tokens import all_special_tokens

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "good", "bad", "movie", "film"]


@pytest.fixture(scope="module")
def word_tokenizer() -> Tokenizer:
    """Whitespace word-level tokenizer carrying the project's special tokens (<cls>, <sep>, <pad>, ...)."""
    vocab = {t: i for i, t in enumerate([*all_special_tokens(), *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_tsv(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(tok: Tokenizer, text: str) -> list[int]:
    return [tok.token_to_id(w) for w in text.split()]


def test_single_sentence_tsv(word_tokenizer, tmp_path):
    train = write_tsv(tmp_path / "train.tsv", [["sentence", "label"], ["good movie", "1"], ["bad", "0"]])
    dev = write_tsv(tmp_path / "dev.tsv", [["sentence", "label"], ["the cat sat", "0"], ["good", "1"]])
    dm = FinetuneDataModule(word_tokenizer, train, dev, task="SST-2", micro_batch_size=2)
    batch = next(iter(dm.val_dataloader()))
    cls, sep, pad = (word_tokenizer.token_to_id(t) for t in ("<cls>", "<sep>", "<pad>"))
    assert batch["input_ids"].tolist() == [
        [cls, *ids(word_tokenizer, "the cat sat"), sep],
        [cls, *ids(word_tokenizer, "good"), sep, pad, pad],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch["token_type_ids"].tolist() == [[0] * 5] * 2
    assert batch["labels"].tolist() == [0, 1] and batch["labels"].dtype == torch.long
    assert dm.label_names == ["0", "1"] and dm.num_labels == 2


def test_pairs_jsonl_regression_and_truncation(word_tokenizer, tmp_path):
    rows = [
        {"s1": "the cat sat on the mat", "s2": "a dog ran", "score": 4.5},
        {"s1": "good", "s2": "bad film", "score": 0},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dm = FinetuneDataModule(
        word_tokenizer, path, text_columns=["s1", "s2"], label_column="score", regression=True, max_length=8
    )
    dm.setup("fit")
    (long_ids, long_types, y0), (short_ids, short_types, y1) = dm.examples["train"]
    cls, sep = word_tokenizer.token_to_id("<cls>"), word_tokenizer.token_to_id("<sep>")
    # 6 + 3 text tokens + 3 specials > 8: longest-first truncation trims only the longer text
    assert long_ids == [cls, *ids(word_tokenizer, "the cat sat"), sep, *ids(word_tokenizer, "a dog"), sep]
    assert long_types == [0, 0, 0, 0, 0, 1, 1, 1]
    assert short_ids == [cls, *ids(word_tokenizer, "good"), sep, *ids(word_tokenizer, "bad film"), sep]
    assert short_types == [0, 0, 0, 1, 1, 1]
    assert (y0, y1) == (4.5, 0.0) and dm.num_labels == 1
    batch = next(iter(dm.train_dataloader()))
    assert batch["labels"].dtype == torch.float32 and batch["input_ids"].shape == (2, 8)


def test_custom_template(word_tokenizer, tmp_path):
    train = write_tsv(tmp_path / "t.tsv", [["a", "b", "y"], ["good", "bad", "x"], ["bad", "good", "z"]])
    dm = FinetuneDataModule(
        word_tokenizer,
        train,
        text_columns=["a", "b"],
        label_column="y",
        template="<s> $A </s> </s> $B:1 </s>:1",
    )
    dm.setup("fit")
    s, e = word_tokenizer.token_to_id("<s>"), word_tokenizer.token_to_id("</s>")
    good, bad = ids(word_tokenizer, "good bad")
    assert dm.examples["train"][0][:2] == ([s, good, e, e, bad, e], [0, 0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer"):
        FinetuneDataModule(word_tokenizer, train, text_columns=["a"], label_column="y", template="<nope> $A")
    with pytest.raises(ValueError, match=r"\$A and \$B"):
        FinetuneDataModule(
            word_tokenizer, train, text_columns=["a", "b"], label_column="y", template="$A <sep>"
        )


def test_labels_are_ordered_and_shuffle_is_seeded(word_tokenizer, tmp_path):
    rows = [["s", "y"]] + [[WORDS[i % len(WORDS)], str(label)] for i, label in enumerate([10, 2, 0] * 10)]
    train = write_tsv(tmp_path / "train.tsv", rows)
    dm = FinetuneDataModule(word_tokenizer, train, text_columns=["s"], label_column="y", micro_batch_size=4)
    assert dm.num_labels == 3 and dm.label_names == ["0", "2", "10"]  # numeric order

    def epoch(seed: int) -> list[int]:
        dm.seed = seed
        return [x for b in dm.train_dataloader() for x in b["input_ids"][:, 1].tolist()]

    assert epoch(0) == epoch(0) != epoch(1)
    assert sorted(epoch(0)) == sorted(word_tokenizer.token_to_id(r[0]) for r in rows[1:])  # each once


def test_unseen_validation_label_is_an_error(word_tokenizer, tmp_path):
    train = write_tsv(tmp_path / "train.tsv", [["sentence", "label"], ["good", "pos"], ["bad", "neg"]])
    dev = write_tsv(tmp_path / "dev.tsv", [["sentence", "label"], ["good", "neutral"]])
    dm = FinetuneDataModule(word_tokenizer, train, dev, task="sst2")
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "['neutral']" in msg and str(dev) in msg and "['neg', 'pos']" in msg


def test_missing_columns_name_file_and_available_columns(word_tokenizer, tmp_path):
    train = write_tsv(tmp_path / "train.tsv", [["text", "target"], ["good", "1"]])
    dm = FinetuneDataModule(word_tokenizer, train, task="sst2")
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert str(train) in msg and "['sentence', 'label']" in msg and "['text', 'target']" in msg
    with pytest.raises(ValueError, match="line 3: 1 tab-separated fields, expected 2"):
        read_table(write_tsv(tmp_path / "bad.tsv", [["a", "b"], ["x", "y"], ["z"]]))
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        FinetuneDataModule(word_tokenizer, tmp_path / "nope.tsv", task="sst2")
    with pytest.raises(ValueError, match="unknown task"):
        FinetuneDataModule(word_tokenizer, train, task="squad")


@pytest.fixture(scope="module")
def bert_pair(shared_data, tmp_path_factory):
    """(ours, transformers.BertTokenizerFast): one WordPiece vocab, trained on GLUE dev text."""
    import transformers

    glue = shared_data / "cls" / "glue"
    text = []
    for task, cols in (("MRPC", ("#1 String", "#2 String")), ("SST-2", ("sentence",))):
        _, rows = read_table(glue / task / "dev.tsv")
        text += [row[c] for row in rows for c in cols]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(text, trainers.WordPieceTrainer(vocab_size=2000, special_tokens=specials))
    vocab = tmp_path_factory.mktemp("bert") / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])))
    return tok, transformers.BertTokenizerFast(str(vocab), do_lower_case=True)


BERT_ROLES = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]"}


@pytest.mark.parametrize("task,n_rows", [("MRPC", 408), ("SST-2", 872), ("STS-B", 1500)])
def test_glue_dev_matches_transformers_bert_tokenizer(bert_pair, shared_data, task, n_rows):
    ours, hf = bert_pair
    glue = shared_data / "cls" / "glue" / task
    dm = FinetuneDataModule(
        ours,
        glue / "dev.tsv",
        glue / "dev.tsv",
        task=task,
        special_tokens=BERT_ROLES,
        max_length=24,
        micro_batch_size=64,
    )
    batches = list(dm.val_dataloader())
    assert sum(len(b["labels"]) for b in batches) == n_rows
    _, rows = read_table(glue / "dev.tsv")
    fmt = dm.format
    for start, batch in zip(range(0, n_rows, 64), batches, strict=True):
        chunk = rows[start : start + 64]
        texts = [[row[c] for row in chunk] for c in fmt.text_columns]
        ref = hf(*texts, truncation=True, max_length=24, padding="longest", return_tensors="pt")
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0)
        if fmt.regression:
            assert batch["labels"].tolist() == pytest.approx([float(row[fmt.label_column]) for row in chunk])
        else:
            assert [dm.label_names[i] for i in batch["labels"]] == [row[fmt.label_column] for row in chunk]


def test_headerless_cola(word_tokenizer, shared_data):
    dev = shared_data / "cls" / "glue" / "CoLA" / "dev.tsv"
    dm = FinetuneDataModule(word_tokenizer, dev, task="cola")
    dm.setup("fit")
    assert len(dm.examples["train"]) == 1043 and dm.label_names == ["0", "1"]
    _, rows = read_table(dev, header=False)
    assert rows[0]["3"] == "The sailors rode the breeze clear of the rocks."
