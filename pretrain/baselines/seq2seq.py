"""RNN encoder-decoder with attention on line-aligned parallel text (``task: parallel``, e.g. Multi30k) or a
toy task (``reverse``, ``copy``); greedy or beam decoding, BLEU (sacrebleu), exact match, attention heatmaps."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader

from pretrain.baselines.config import Seq2SeqBaseline
from pretrain.baselines.data import ensure_tokenizer
from pretrain.baselines.heatmaps import alignment, save_alignment, token_labels
from pretrain.baselines.module import BaselineModule, fit, token_sums, val_metrics
from pretrain.config import RunConfig
from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, special_token_id
from pretrain.datamodules.tokenizer import TextEncoder
from pretrain.errors import InputError
from pretrain.models.rnn import Seq2SeqRNN
from pretrain.models.word_vectors import (
    word_tokenizer,
)
from pretrain.objectives.loss import IGNORE_INDEX


def pad_pairs(
    pairs: Sequence[tuple[list[int], list[int]]], pad: int, bos: int, eos: int
) -> dict[str, Tensor]:
    """(source, target) id lists -> ``input_ids``/``attention_mask`` (B, S); ``decoder_input_ids`` = [BOS] + y,
    ``labels`` = y + [EOS] (-100 on padding), ``decoder_attention_mask`` (B, T)."""
    S, T = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs) + 1
    out = {
        "input_ids": torch.full((len(pairs), S), pad),
        "attention_mask": torch.zeros(len(pairs), S, dtype=torch.long),
        "decoder_input_ids": torch.full((len(pairs), T), pad),
        "decoder_attention_mask": torch.zeros(len(pairs), T, dtype=torch.long),
        "labels": torch.full((len(pairs), T), IGNORE_INDEX),
    }
    for b, (src, tgt) in enumerate(pairs):
        out["input_ids"][b, : len(src)] = torch.tensor(src)
        out["attention_mask"][b, : len(src)] = 1
        out["decoder_input_ids"][b, : len(tgt) + 1] = torch.tensor([bos, *tgt])
        out["decoder_attention_mask"][b, : len(tgt) + 1] = 1
        out["labels"][b, : len(tgt) + 1] = torch.tensor([*tgt, eos])
    return out


@dataclass
class Example:
    source: list[int]
    target: list[int]
    reference: str  # target text, for BLEU


class ParallelData(L.LightningDataModule):
    """Source-target examples in padded batches (training shuffled by a seeded generator)."""

    def __init__(
        self, train: list[Example], val: list[Example], batch_size: int, seed: int, ids: dict[str, int]
    ):
        super().__init__()
        if not train:
            raise InputError("no training pairs (all empty or longer than max_length?)")
        self.train, self.val, self.batch_size, self.seed, self.ids = train, val, batch_size, seed, ids

    def _collate(self, examples: list[Example]) -> dict[str, Tensor]:
        return pad_pairs(
            [(e.source, e.target) for e in examples], self.ids["pad"], self.ids["bos"], self.ids["eos"]
        )

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train,  # type: ignore[arg-type]  # a list is a map-style dataset; torch's stub asks for Dataset
            batch_size=self.batch_size,
            shuffle=True,
            generator=g,
            collate_fn=self._collate,
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val:
            return []
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self._collate)  # type: ignore[arg-type]


def symbol_id(tokenizer: Tokenizer, symbol: str) -> int:
    """The id of a toy task's symbol; ``InputError`` when the tokenizer has none (a tokenizer of another task)."""
    found = tokenizer.token_to_id(symbol)
    if found is None:
        raise InputError(f"the tokenizer has no token {symbol!r}: give the toy task's own tokenizer")
    return found


def toy_examples(
    task: str, count: int, tokenizer: Tokenizer, symbols: int, lengths: tuple[int, int], seed: int
) -> list[Example]:
    """``reverse`` (y = x reversed) or ``copy`` (y = x) of random strings of symbols "0".."n-1"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        words = [str(s) for s in rng.integers(0, symbols, size=rng.integers(lengths[0], lengths[1] + 1))]
        target = words[::-1] if task == "reverse" else words
        ids = [symbol_id(tokenizer, w) for w in words]
        out.append(Example(ids, ids[::-1] if task == "reverse" else ids, " ".join(target)))
    return out


def read_lines(path: str | os.PathLike) -> list[str]:
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def parallel_examples(
    files: Sequence[str], tokenizer: Tokenizer, max_length: int, drop_long: bool
) -> list[Example]:
    """Line-aligned ``[source, target]`` files -> examples (long pairs dropped, or truncated for evaluation)."""
    if len(files) != 2:
        raise InputError(f"parallel data needs [source file, target file], got {list(files)}")
    src, tgt = read_lines(files[0]), read_lines(files[1])
    if len(src) != len(tgt):
        raise InputError(f"{files[0]} has {len(src)} lines but {files[1]} has {len(tgt)}; they must align")
    encode = TextEncoder(tokenizer)  # special-token strings in the lines stay text
    out = []
    for s, t, ref in zip(encode(src), encode(tgt), tgt):
        if not s or not t or (drop_long and max(len(s), len(t)) > max_length):
            continue
        out.append(Example(s[:max_length], t[:max_length], ref.strip()))
    return out


class Seq2SeqModule(BaselineModule):
    """Teacher-forced token cross-entropy of :class:`pretrain.models.rnn.Seq2SeqRNN`."""

    reports_perplexity = True

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return token_sums(logits, batch["labels"])


def decode_seq2seq(
    model: Seq2SeqRNN, examples: Sequence[Example], cfg: Seq2SeqBaseline, batch_size: int
) -> list[list[int]]:
    """Greedy (``beam_size`` 1, ``pretrain.models.generation.generate``) or beam (``pretrain.models.beam_search``) outputs,
    without BOS and cut at EOS."""
    from pretrain.models.beam_search import beam_search
    from pretrain.models.generation import generate

    c = model.config
    assert (
        c.decoder_start_token_id is not None and c.eos_token_id is not None
    )  # set from the tokenizer's roles
    outputs = []
    for start in range(0, len(examples), batch_size):
        batch = pad_pairs(
            [(e.source, e.target) for e in examples[start : start + batch_size]],
            c.pad_token_id,
            c.decoder_start_token_id,
            c.eos_token_id,
        )
        src, mask = batch["input_ids"], batch["attention_mask"]
        if cfg.beam_size > 1:
            seqs = beam_search(
                model,
                None,
                cfg.max_length,
                num_beams=cfg.beam_size,
                length_penalty=cfg.length_penalty,
                encoder_input_ids=src,
                encoder_attention_mask=mask,
            ).sequences
        else:
            seqs = generate(
                model, None, cfg.max_length, greedy=True, encoder_input_ids=src, encoder_attention_mask=mask
            )
        for row in seqs[:, 1:].tolist():
            row = row[: row.index(c.eos_token_id)] if c.eos_token_id in row else row
            outputs.append([t for t in row if t != c.pad_token_id])  # beam search pads short hypotheses
    return outputs


def evaluate_seq2seq(
    model: Seq2SeqRNN, tokenizer: Tokenizer, examples: list[Example], cfg: Seq2SeqBaseline, batch_size: int
) -> dict[str, float]:
    """BLEU (sacrebleu, detokenized outputs vs reference text) and exact match of decoded outputs."""
    import sacrebleu

    if cfg.eval_examples is not None:
        examples = examples[: cfg.eval_examples]
    outputs = decode_seq2seq(model.eval(), examples, cfg, batch_size)
    hypotheses = [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outputs]
    references = [e.reference for e in examples]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references])
    exact = float(np.mean([o == e.target for o, e in zip(outputs, examples)]))
    return {"bleu": bleu.score, "exact_match": exact, "examples": len(examples)}


def run_seq2seq(run: RunConfig, cfg: Seq2SeqBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    out_dir = run.run_path
    if cfg.task == "parallel":
        tokenizer = ensure_tokenizer(run)
        train = parallel_examples(cfg.train, tokenizer, cfg.max_length, drop_long=True)
        splits = {
            name: parallel_examples(files, tokenizer, cfg.max_length, drop_long=False)
            for name, files in (("val", cfg.val), ("test", cfg.test))
            if files
        }
    else:
        tokenizer = word_tokenizer(
            [str(i) for i in range(cfg.toy_symbols)], list(DEFAULT_SPECIAL_TOKENS.values())
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(out_dir / "tokenizer.json"))
        lengths = (cfg.toy_min_length, cfg.toy_max_length)
        train, val = (
            toy_examples(cfg.task, n, tokenizer, cfg.toy_symbols, lengths, run.seed + i)
            for i, n in ((0, cfg.toy_train), (1, cfg.toy_val))
        )
        splits = {"val": val}
    ids = {
        role: special_token_id(tokenizer, role, run.tokenizer.special_tokens)
        for role in ("pad", "bos", "eos")
    }
    from pretrain.datamodules.tokenizer import check_tokenizer

    check_tokenizer(tokenizer, cfg.model.vocab_size)
    model = Seq2SeqRNN(
        dataclasses.replace(
            cfg.model, pad_token_id=ids["pad"], eos_token_id=ids["eos"], decoder_start_token_id=ids["bos"]
        )
    )
    data = ParallelData(train, splits.get("val", []), run.data.micro_batch_size, run.seed, ids)
    trainer = fit(run, resolved, Seq2SeqModule(model, run.optim, run.trainer.max_steps), data)
    results: dict[str, Any] = {
        "parameters": model.num_params(),
        "train_pairs": len(train),
        **val_metrics(trainer),
    }
    for name, examples in splits.items():
        results.update(
            {f"{name}/{k}": v for k, v in evaluate_seq2seq(model, tokenizer, examples, cfg, 64).items()}
        )
    heatmaps = []
    for i, example in enumerate(splits.get("val", [])[: cfg.heatmaps]):
        output = decode_seq2seq(model, [example], cfg, 1)[0]
        weights = alignment(model, example.source, output)
        target = [*token_labels(tokenizer, output), "</s>"]
        path = save_alignment(
            weights, token_labels(tokenizer, example.source), target, out_dir / "alignments" / f"val-{i}.png"
        )
        heatmaps.append(str(path))
    results["heatmaps"] = heatmaps
    return results
