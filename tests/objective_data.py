"""Objective-test data: a tiny BPE tokenizer with every special token, the packed shipped corpus, builders."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain import objectives
from pretrain.datamodules.special_tokens import all_special_tokens, sentinel_token
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

CORPUS = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tinyshakespeare.txt"


ALL_OBJECTIVES = {
    "clm": {},
    "mlm": {"span_masking": True, "whole_word_mask": True},
    "span_corruption": {},
    "prefix_lm": {},
    "prefix_lm_encdec": {"arch": "encoder-decoder"},
    "ul2": {"input_length": 64},
}


def corpus_paragraphs() -> list[str]:
    """Paragraphs (speeches) of the shipped corpus: the 'documents' of the tests."""
    return [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]


@functools.cache
def tiny_tokenizer(num_sentinels: int = 100, without: tuple[str, ...] = ()) -> Tokenizer:
    """Byte-level BPE (1000 ids) trained on the first speeches of the corpus, with all special tokens
    (``num_sentinels`` sentinels) except those in ``without``."""
    specials = [t for t in all_special_tokens(num_sentinels) if t not in without]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(corpus_paragraphs()[:1500], trainer)
    return tok


def tiny_model_config(arch: str, **fields: object) -> ModelConfig:
    """A 2-layer, d 32 model over ``tiny_tokenizer``'s vocabulary (``fields`` override or add)."""
    vocab = tiny_tokenizer().get_vocab_size()
    base = {"arch": arch, "vocab_size": vocab, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64}
    return ModelConfig(**{**base, "max_seq_len": 128, **fields})  # type: ignore[arg-type]


@functools.cache
def packed_stream(num_sentinels: int = 100) -> torch.Tensor:
    """Token ids of the corpus's speeches, each followed by EOS, concatenated (1-D)."""
    tok = tiny_tokenizer(num_sentinels)
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for enc in tok.encode_batch(corpus_paragraphs()[:3000]):
        ids += [*enc.ids, eos]
    return torch.tensor(ids)


def packed_batch(batch_size: int, length: int, seed: int = 0, num_sentinels: int = 100) -> torch.Tensor:
    """``(B, L)`` windows at random offsets of the packed stream, as the datamodule would sample them."""
    stream = packed_stream(num_sentinels)
    starts = torch.randint(
        0, len(stream) - length, (batch_size,), generator=torch.Generator().manual_seed(seed)
    )
    return stream[starts[:, None] + torch.arange(length)]


def build(key: str):
    return objectives.build(key.removesuffix("_encdec"), tiny_tokenizer(), **ALL_OBJECTIVES[key])


def generators(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def assert_equal_batches(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        assert torch.equal(value, b[k]), k


def tiny_model(arch: str, vocab_size: int):
    """``(model, logits_fn)``: the real backbone, tiny, dropout off."""
    torch.manual_seed(0)
    config = ModelConfig(
        arch=arch, vocab_size=vocab_size, d_model=32, n_layer=2, n_head=2, max_seq_len=256, position="learned"
    )
    return Transformer(config).eval(), lambda m, **kw: m(**kw).logits


def sentinel_set(tok) -> dict[int, int]:
    """sentinel id -> its index k (<extra_id_k>)."""
    ids = {tok.token_to_id(sentinel_token(k)): k for k in range(1000)}
    return {i: k for i, k in ids.items() if i is not None}


def rebuild(inputs: list[int], targets: list[int], sentinels: dict[int, int]) -> list[int]:
    """The original sequence from T5 (inputs, targets), both ending with EOS."""
    spans: dict[int, list[int]] = {}
    current = None
    for t in targets[:-1]:
        if t in sentinels:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    out: list[int] = []
    for t in inputs[:-1]:
        out += spans[t] if t in sentinels else [t]
    return out
