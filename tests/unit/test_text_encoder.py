"""Special-token text stays text wherever user text is encoded (``TextEncoder``), for every special token of our
tokenizer and of GPT-2's; the lm-eval scorer encodes as lm-eval's HF model does; old corpora are stale."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer

from pretrain.datamodules.finetune import FinetuneDataModule
from pretrain.datamodules.indexed import IndexedDataset
from pretrain.datamodules.prepare import FORMAT_VERSION, prepare, stale_reason
from pretrain.datamodules.text2text import Text2TextDataModule
from pretrain.datamodules.tokenizer import TextEncoder, load_tokenizer


def special_strings(tokenizer: Tokenizer) -> dict[str, int]:
    """Every special added token of ``tokenizer``: content -> id."""
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


@pytest.fixture(scope="module")
def tokenizers(tiny_world, shared_data) -> dict[str, Tokenizer]:
    return {
        "ours": load_tokenizer(tiny_world["tokenizer"]),
        "gpt2": load_tokenizer(shared_data / "tokenizers" / "gpt2"),
    }


def spelled(specials: dict[str, int]) -> str:
    """A text that spells every special token, glued to words and between spaces."""
    return " ".join(f"x{s}y {s} <s>{s}</s>" for s in specials)


@pytest.mark.parametrize("name", ["ours", "gpt2"])
def test_text_spelling_special_tokens_stays_text(tokenizers, name):
    tokenizer = tokenizers[name]
    specials = special_strings(tokenizer)
    assert len(specials) >= (
        1 if name == "gpt2" else 110
    )  # GPT-2: <|endoftext|>; ours: roles, sentinels, UL2
    text = spelled(specials)
    assert set(tokenizer.encode(text, add_special_tokens=False).ids) & set(specials.values())  # the trap
    encoder = TextEncoder(tokenizer)
    for ids in (
        encoder(["", text])[1],
        encoder.encode(text),
        pickle.loads(pickle.dumps(encoder)).encode(text),
    ):
        assert not set(ids) & set(specials.values())
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode(text, add_special_tokens=False).ids != encoder.encode(
        text
    )  # caller's is untouched


def test_prepare_writes_special_text_as_text(tmp_path, tokenizers):
    tokenizer = tokenizers["ours"]
    specials = special_strings(tokenizer)
    docs = [f"doc {i} <s>struck</s> {spelled(specials)}" for i in range(3)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs), encoding="utf-8")
    meta = prepare(tmp_path / "c.txt", tokenizer, tmp_path / "out", val_fraction=0.0, progress=False)
    data = IndexedDataset(tmp_path / "out" / "train")
    eos = meta["eos_id"]
    assert len(data) == 3 and meta["format_version"] == FORMAT_VERSION
    for i, doc in enumerate(docs):
        ids = data[i].tolist()
        assert ids[-1] == eos and not set(ids[:-1]) & set(specials.values())  # EOS only where prepare put it
        assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == doc


def test_corpus_of_an_older_format_is_stale(tmp_path, tokenizers):
    tokenizer = tokenizers["ours"]
    (tmp_path / "c.txt").write_text("a </s> b\n\nc <mask> d", encoding="utf-8")
    prepare(tmp_path / "c.txt", tokenizer, tmp_path / "out", val_fraction=0.0, progress=False)
    assert stale_reason(tmp_path / "out", tmp_path / "c.txt", tokenizer, val_fraction=0.0) is None
    meta_path = tmp_path / "out" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"], meta["cache_key"] = 2, "the key of format 2"  # as written before the fix
    meta_path.write_text(json.dumps(meta))
    reason = stale_reason(tmp_path / "out", tmp_path / "c.txt", tokenizer, val_fraction=0.0)
    assert "format version 2" in reason and "special-token strings" in reason
    with pytest.warns(UserWarning, match="special-token strings"):
        rebuilt = prepare(tmp_path / "c.txt", tokenizer, tmp_path / "out", val_fraction=0.0, progress=False)
    assert not rebuilt["cache_hit"] and rebuilt["format_version"] == FORMAT_VERSION


def test_finetuning_and_text2text_keep_special_text(tmp_path, tokenizers):
    tokenizer = tokenizers["ours"]
    ids = special_strings(tokenizer)
    rows = ["sentence\tlabel", "a <sep> b </s> c\t0", "<cls> <mask> <pad>\t1"]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    data = FinetuneDataModule(tokenizer, tmp_path / "train.tsv", task="sst2", micro_batch_size=2)
    data.setup("fit")
    for row, (example, _, _) in zip(rows[1:], data.examples["train"], strict=True):
        assert example[0] == ids["<cls>"] and example[-1] == ids["<sep>"]  # the template's, by id
        assert not set(example[1:-1]) & set(ids.values())
        assert tokenizer.decode(example[1:-1], skip_special_tokens=False) == row.split("\t")[0]
    pairs = [("translate: a </s> b <extra_id_0>", "c <pad> </s>")]
    t2t = Text2TextDataModule(tokenizer, pairs, pad_id=ids["<pad>"], eos_id=ids["</s>"], decoder_start_id=0)
    t2t.setup("fit")
    ((source, target, _),) = t2t.examples["train"]
    for encoded, text in ((source, pairs[0][0]), (target, pairs[0][1])):
        assert encoded[-1] == ids["</s>"] and not set(encoded[:-1]) & set(ids.values())
        assert tokenizer.decode(encoded[:-1], skip_special_tokens=False) == text


def test_scorer_encodes_as_lm_eval_hf_model(tokenizers, shared_data):
    """lm-eval's HFLM encodes prompts with a transformers fast tokenizer, which matches special-token text as
    control tokens; the scorer does the same, so its scores stay lm-eval's (docs/data.md)."""
    from transformers import GPT2TokenizerFast

    from pretrain.evaluation.scoring import LMScorer

    hf = GPT2TokenizerFast(
        str(shared_data / "tokenizers/gpt2/vocab.json"), str(shared_data / "tokenizers/gpt2/merges.txt")
    )
    scorer = LMScorer(logits_fn=None, tokenizer=tokenizers["gpt2"], max_length=64, prefix_token_id=50256)
    for text in ("a <|endoftext|> b", "Question: <|endoftext|>?\nAnswer:", "x<|endoftext|>y"):
        assert scorer.encode(text) == hf.encode(text)
        assert 50256 in scorer.encode(text)
    assert np.array_equal(scorer.encode_pair("Q: <|endoftext|>", " A")[0], hf.encode("Q: <|endoftext|>"))
