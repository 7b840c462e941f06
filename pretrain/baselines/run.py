"""The baselines the transformer replaced, on the same tokenizer, prepared corpora, Trainer, loggers and metrics.

    pretrain baseline recipes/sgns-tiny.yaml [key=value ...] [--print-config]

A baseline recipe composes like a pretraining recipe (``pretrain.config.compose``) and shares its sections
(tokenizer, data, objective, optim, trainer, strategy, logger, checkpoint; ``model`` is unused). Its own section
``baselines`` (pieces in ``configs/baselines/``) names the ``kind`` and holds its options:

    sgns     skip-gram / CBOW (``objectives.sgns``) on the prepared corpus through ``PretrainDataModule``
    glove    GloVe (``objectives.glove``) on the co-occurrence matrix of the prepared train split
    rnn_lm   LSTM/GRU language model (``pretrain.models.rnn``) trained with the ``clm`` objective by truncated BPTT:
             the train stream is cut into B parallel streams and batch i+1 continues batch i row by row, the
             hidden state carried (detached) between batches and reset every epoch and every validation
    seq2seq  RNN encoder-decoder with attention on line-aligned parallel text (``task: parallel``, e.g.
             Multi30k) or a toy task (``reverse``, ``copy``); greedy or beam decoding, BLEU (sacrebleu), exact
             match, attention heatmaps

A missing tokenizer is trained and missing prepared corpora are written first (as ``pretrain tokenizer`` and
``pretrain prepare`` do). Runs use one device and start fresh. Outputs under ``run_dir``: Lightning
checkpoints and logs, ``results.json``; word vectors also ``vectors.txt`` (word2vec text format), seq2seq
also ``alignments/*.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from datamodules.indexed import IndexedDataset
from datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, special_token_id
from objectives.base import Objective
from objectives.glove import Cooccurrence, GloVe
from objectives.loss import IGNORE_INDEX, token_cross_entropy
from objectives.sgns import SkipGram, check_counts, token_counts
from pretrain import config
from pretrain.config import OptimConfig, RunConfig, SourceConfig
from pretrain.models.rnn import RNNConfig, RNNLanguageModel, Seq2SeqConfig, Seq2SeqRNN, detach_cache
from pretrain.models.word_vectors import (
    GloVeModel,
    Word2Vec,
    WordVectors,
    read_analogies,
    read_similarity,
    word_tokenizer,
)
from pretrain.training.optim import build_optimizer, build_scheduler

# ---------------------------------------------------------------------------------------------- configuration


@dataclass
class WordEvalConfig:
    """Evaluation of word vectors after training (files are optional)."""

    queries: list[str] = field(default_factory=list)  # words whose nearest neighbours are reported
    neighbours: int = 10
    analogies: str | None = None  # "a b c d" per line (Google questions-words.txt format)
    similarity: str | None = None  # "word1 word2 score" per line (WordSim-353, SimLex-999)
    export: bool = True  # <run_dir>/vectors.txt in word2vec text format


@dataclass
class SGNSBaseline:
    kind: Literal["sgns"] = "sgns"
    dim: int = 100
    window: int = 5
    negatives: int = 5
    subsample: float = 1e-3
    min_count: int = 5
    cbow: bool = False
    full_softmax: bool = False
    noise_power: float = 0.75
    eval: WordEvalConfig = field(default_factory=WordEvalConfig)

    def __post_init__(self) -> None:
        check_counts(dim=self.dim, window=self.window, negatives=self.negatives, min_count=self.min_count)


@dataclass
class GloVeBaseline:
    kind: Literal["glove"] = "glove"
    dim: int = 100
    window: int = 10
    min_count: int = 5
    x_max: float = 100.0
    alpha: float = 0.75
    symmetric: bool = True
    batch_size: int = 4096  # co-occurrence entries per step
    eval: WordEvalConfig = field(default_factory=WordEvalConfig)

    def __post_init__(self) -> None:
        check_counts(dim=self.dim, window=self.window, min_count=self.min_count, batch_size=self.batch_size)


@dataclass
class RNNLMBaseline:
    kind: Literal["rnn_lm"] = "rnn_lm"
    model: RNNConfig = field(default_factory=RNNConfig)
    # held-out text read whole as the validation stream (its prepared *train* split); default: the val splits
    # of data.sources
    validation: SourceConfig | None = None


@dataclass
class Seq2SeqBaseline:
    kind: Literal["seq2seq"] = "seq2seq"
    model: Seq2SeqConfig = field(default_factory=Seq2SeqConfig)
    task: Literal["parallel", "reverse", "copy"] = "parallel"
    # parallel: [source file, target file] per split, line-aligned (.gz ok)
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    max_length: int = 64  # tokens per side: longer training pairs are dropped; also the decoding limit
    # toy tasks: strings of symbols "0".."toy_symbols-1", lengths uniform in [toy_min_length, toy_max_length]
    toy_symbols: int = 10
    toy_min_length: int = 2
    toy_max_length: int = 8
    toy_train: int = 20000
    toy_val: int = 500
    beam_size: int = 1  # 1: greedy
    length_penalty: float = 1.0
    eval_examples: int | None = 1000  # decoded per split for BLEU / exact match (None: all)
    heatmaps: int = 3  # attention heatmaps saved (first validation examples)

    def __post_init__(self) -> None:
        check_counts(
            max_length=self.max_length,
            toy_symbols=self.toy_symbols,
            toy_min_length=self.toy_min_length,
            toy_train=self.toy_train,
            beam_size=self.beam_size,
        )
        if self.toy_max_length < self.toy_min_length:
            raise ValueError(
                f"toy_max_length ({self.toy_max_length}) must be >= toy_min_length ({self.toy_min_length})"
            )
        if self.task == "parallel" and len(self.train) != 2:
            raise ValueError(f"task=parallel needs train=[source file, target file], got {self.train}")


BASELINES = {
    "sgns": SGNSBaseline,
    "glove": GloVeBaseline,
    "rnn_lm": RNNLMBaseline,
    "seq2seq": Seq2SeqBaseline,
}


def load(recipe: str | Path, overrides: list[str] | None = None) -> tuple[RunConfig, Any, dict[str, Any]]:
    """Compose and validate a baseline recipe: ``(shared run config, baseline section, resolved dict)``."""
    raw = config.compose(recipe, overrides)
    section = raw.pop("baselines", None)
    if not isinstance(section, dict) or section.get("kind") not in BASELINES:
        raise ValueError(
            f"{recipe}: a baseline recipe needs a section `baselines` with kind in {list(BASELINES)} "
            f"(pieces in configs/baselines/), got {section!r:.80}"
        )
    run = config.validate(raw)
    baseline = config.structured(BASELINES[section["kind"]], section, "baselines")
    if run.trainer.devices != 1 or run.trainer.num_nodes != 1:
        raise ValueError("baselines train on one device; set trainer.devices=1 trainer.num_nodes=1")
    resolved = {k: v for k, v in config.to_dict(run).items() if k not in ("model", "resume")}  # unused here
    return run, baseline, {**resolved, "baselines": dataclasses.asdict(baseline)}


# ---------------------------------------------------------------------------------------------- data


def ensure_tokenizer(run: RunConfig) -> Tokenizer:
    """The recipe's tokenizer, trained first (byte-level BPE) when missing and ``tokenizer.train_files`` is set."""
    from datamodules.tokenizer import load_tokenizer, train_bpe

    path = Path(run.tokenizer.path)
    if not path.exists() and run.tokenizer.train_files:
        train_bpe(
            list(run.tokenizer.train_files),
            run.tokenizer.vocab_size,
            path,
            min_frequency=run.tokenizer.min_frequency,
            show_progress=False,
        )
    return load_tokenizer(path)


def ensure_prepared(source: SourceConfig, tokenizer: Tokenizer, val_fraction: float) -> Path:
    """``source.prepared`` (re)written from ``source.text`` unless up to date (``datamodules.prepare`` cache)."""
    from datamodules.prepare import prepare

    if source.text:
        prepare(list(source.text), tokenizer, source.prepared, val_fraction=val_fraction, progress=False)
    elif not (Path(source.prepared) / "meta.json").is_file():
        raise FileNotFoundError(
            f"data source {source.name!r}: {source.prepared} is not a prepared corpus and no raw text is listed "
            "(data.sources[].text)"
        )
    return Path(source.prepared)


def split_tokens(directories: Sequence[Path], split: str) -> np.ndarray:
    """The token streams of ``split`` of prepared directories, one after the other (1-D int64)."""
    parts = [np.asarray(IndexedDataset(Path(d) / split).tokens, dtype=np.int64) for d in directories]
    tokens = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if tokens.size == 0:
        raise ValueError(f"the {split} split of {[str(d) for d in directories]} is empty")
    return tokens


class StreamBatches(Dataset):
    """Truncated-BPTT batches of a 1-D stream: B parallel streams of ``n = len // B`` tokens; item i holds tokens
    ``[i T, i T + T + 1)`` of every stream -> the objective's batch (clm: inputs and next-token labels)."""

    def __init__(self, tokens: np.ndarray, objective: Objective, seq_len: int, batch_size: int):
        n = len(tokens) // batch_size
        if n < seq_len + 1:
            raise ValueError(
                f"a stream of {len(tokens)} tokens gives {batch_size} streams of {n} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; lower data.micro_batch_size or data.seq_len"
            )
        self.streams = torch.from_numpy(tokens[: n * batch_size].reshape(batch_size, n))  # (B, n)
        self.objective, self.seq_len = objective, seq_len

    def __len__(self) -> int:
        return (self.streams.shape[1] - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range for {len(self)} batches")
        start = i * self.seq_len
        tokens = self.streams[:, start : start + self.seq_len + 1]
        return self.objective(tokens, torch.Generator().manual_seed(i))


class StreamDataModule(L.LightningDataModule):
    """Contiguous streams for recurrent language models (see :class:`StreamBatches`); validation in order."""

    def __init__(
        self, train: np.ndarray, val: np.ndarray | None, objective: Objective, seq_len: int, batch_size: int
    ):
        super().__init__()
        self.train_set = StreamBatches(train, objective, seq_len, batch_size)
        self.val_set = None if val is None else StreamBatches(val, objective, seq_len, batch_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_set is None else DataLoader(self.val_set, batch_size=None, shuffle=False)


class IndexBatches(Dataset):
    """Item = a list of indices -> the batch of those rows (batched indexing, no per-row Python)."""

    def __init__(self, make: Any, size: int):
        self.make, self.size = make, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: list[int]) -> Any:
        return self.make(torch.as_tensor(index))


def index_loader(make: Any, size: int, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Batches of ``make(indices)`` over ``range(size)``, shuffled every epoch by a seeded generator."""
    base = (
        RandomSampler(range(size), generator=torch.Generator().manual_seed(seed))
        if shuffle
        else SequentialSampler(range(size))
    )
    sampler = BatchSampler(base, batch_size, drop_last=False)
    return DataLoader(IndexBatches(make, size), sampler=sampler, batch_size=None)


class CooccurrenceData(L.LightningDataModule):
    """GloVe training batches: shuffled non-zero entries ``(input_ids=i, context_ids=j, counts=X_ij)``;
    validation = every entry in order (the objective over the whole matrix)."""

    def __init__(self, x: Cooccurrence, batch_size: int, seed: int):
        super().__init__()
        self.x, self.batch_size, self.seed = x, batch_size, seed

    def _batch(self, index: Tensor) -> dict[str, Tensor]:
        return {
            "input_ids": self.x.rows[index],
            "context_ids": self.x.cols[index],
            "counts": self.x.values[index],
        }

    def train_dataloader(self) -> DataLoader:
        return index_loader(self._batch, len(self.x.values), self.batch_size, True, self.seed)

    def val_dataloader(self) -> DataLoader:
        return index_loader(self._batch, len(self.x.values), 16 * self.batch_size, False, self.seed)


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
            raise ValueError("no training pairs (all empty or longer than max_length?)")
        self.train, self.val, self.batch_size, self.seed, self.ids = train, val, batch_size, seed, ids

    def _collate(self, examples: list[Example]) -> dict[str, Tensor]:
        return pad_pairs(
            [(e.source, e.target) for e in examples], self.ids["pad"], self.ids["bos"], self.ids["eos"]
        )

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train, batch_size=self.batch_size, shuffle=True, generator=g, collate_fn=self._collate
        )

    def val_dataloader(self) -> DataLoader | list:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self._collate) if self.val else []


def toy_examples(
    task: str, count: int, tokenizer: Tokenizer, symbols: int, lengths: tuple[int, int], seed: int
) -> list[Example]:
    """``reverse`` (y = x reversed) or ``copy`` (y = x) of random strings of symbols "0".."n-1"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        words = [str(s) for s in rng.integers(0, symbols, size=rng.integers(lengths[0], lengths[1] + 1))]
        target = words[::-1] if task == "reverse" else words
        ids = [tokenizer.token_to_id(w) for w in words]
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
        raise ValueError(f"parallel data needs [source file, target file], got {list(files)}")
    src, tgt = read_lines(files[0]), read_lines(files[1])
    if len(src) != len(tgt):
        raise ValueError(f"{files[0]} has {len(src)} lines but {files[1]} has {len(tgt)}; they must align")
    encode = lambda lines: [e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=False)]
    out = []
    for s, t, ref in zip(encode(src), encode(tgt), tgt):
        if not s or not t or (drop_long and max(len(s), len(t)) > max_length):
            continue
        out.append(Example(s[:max_length], t[:max_length], ref.strip()))
    return out


# ---------------------------------------------------------------------------------------------- Lightning modules


class BaselineModule(L.LightningModule):
    """A model and a loss giving summable ``loss_sum``, ``num_targets`` (and ``num_correct``) per batch; the mean
    loss of each batch is minimised with the run's AdamW + schedule (``pretrain.training.optim``). Logs ``train/*`` and
    ``val/*`` (loss, accuracy, perplexity for token-prediction models)."""

    reports_perplexity = False
    summarize = Objective.summarize  # loss / accuracy / perplexity from the summed counts

    def __init__(self, model: nn.Module, optim: OptimConfig, max_steps: int, objective: Any = None):
        super().__init__()
        self.model, self.optim, self.max_steps, self.objective = model, optim, max_steps, objective
        self.flops_per_batch: float | None = None  # read by the ThroughputMonitor
        self._val_sums: dict[str, Tensor] = {}

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        raise NotImplementedError

    def _metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        metrics = self.summarize({"num_correct": 0, **sums})
        return metrics if "num_correct" in sums else {k: v for k, v in metrics.items() if k != "accuracy"}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        sums = self.sums(batch, training=True)
        metrics = self._metrics({k: v.detach().float() for k, v in sums.items()})
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], on_step=True, on_epoch=False)
        return sums["loss_sum"] / sums["num_targets"].clamp_min(1)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        for key, value in self.sums(batch, training=False).items():
            self._val_sums[key] = self._val_sums.get(key, 0) + value.detach().float()

    def on_validation_epoch_end(self) -> None:
        if self._val_sums:
            metrics = self._metrics(self._val_sums)
            self.log_dict({f"val/{k}": v for k, v in metrics.items()}, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self.model, self.optim)
        scheduler = build_scheduler(optimizer, self.optim, self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_sums(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Summed token cross-entropy, number of targets and of correct argmax predictions (labels -100 ignored)."""
    loss_sum, num_targets = token_cross_entropy(logits, labels)
    correct = ((logits.detach().argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
    return {"loss_sum": loss_sum, "num_targets": num_targets, "num_correct": correct}


class WordVectorModule(BaselineModule):
    """Word2vec trained with a :class:`objectives.sgns.SkipGram` objective's batches and loss."""

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits = self.model(batch["input_ids"], batch["input_mask"], batch.get("candidates"))
        loss_sum, num_targets = self.objective.loss(logits, batch["labels"])
        correct = self.objective.metrics(logits.detach(), batch["labels"])["num_correct"]
        return {"loss_sum": loss_sum, "num_targets": num_targets, "num_correct": correct}


class GloVeModule(BaselineModule):
    """GloVe's weighted least squares (:class:`objectives.glove.GloVe`) on co-occurrence entries."""

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        prediction = self.model(batch["input_ids"], batch["context_ids"])
        return dict(zip(("loss_sum", "num_targets"), self.objective.loss(prediction, batch["counts"])))


def lm_forward(model: nn.Module, batch: dict[str, Tensor], cache: Any) -> tuple[Tensor, Any]:
    """Logits of a language model on a stream batch; a recurrent model continues from ``cache`` (detached:
    truncated BPTT) and returns its new state, a transformer reads the batch alone."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if isinstance(model, RNNLanguageModel):
        out = model(**inputs, cache=detach_cache(cache), use_cache=True)
        return out.logits, out.cache
    return model(**inputs).logits, None


class LanguageModelModule(BaselineModule):
    """A language model trained with the ``clm`` objective on :class:`StreamDataModule` batches; the state of a
    recurrent model is carried between consecutive batches (:func:`lm_forward`) and reset at every epoch and
    validation start."""

    reports_perplexity = True

    def __init__(self, model: nn.Module, optim: OptimConfig, max_steps: int, objective: Objective):
        super().__init__(model, optim, max_steps, objective)
        self._state: dict[bool, Any] = {True: None, False: None}  # training? -> carried state

    def on_train_epoch_start(self) -> None:
        self._state[True] = None

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._state[False] = None

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits, self._state[training] = lm_forward(self.model, batch, self._state[training])
        labels = batch["labels"]
        if hasattr(self.model, "flops_per_token"):
            self.flops_per_batch = self.model.flops_per_token(labels.shape[1]) * labels.numel()
        return token_sums(logits, labels)


class Seq2SeqModule(BaselineModule):
    """Teacher-forced token cross-entropy of :class:`pretrain.models.rnn.Seq2SeqRNN`."""

    reports_perplexity = True

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return token_sums(logits, batch["labels"])


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate_word_vectors(vectors: WordVectors, cfg: WordEvalConfig, out_dir: Path) -> dict[str, Any]:
    """Neighbours of the queries, analogy accuracy and similarity correlation when files are given; export."""
    results: dict[str, Any] = {"vocabulary": len(vectors)}
    known = [q for q in cfg.queries if vectors.lookup(q) is not None]
    results["neighbours"] = {q: vectors.nearest(q, cfg.neighbours) for q in known}
    results["unknown_queries"] = [q for q in cfg.queries if q not in known]
    if cfg.analogies:
        results.update(vectors.analogy_accuracy(read_analogies(cfg.analogies)))
    if cfg.similarity:
        results.update(vectors.similarity_correlation(read_similarity(cfg.similarity)))
    if cfg.export:
        results["vectors"] = str(vectors.save_word2vec(out_dir / "vectors.txt"))
    return results


@torch.no_grad()
def stream_perplexity(
    model: nn.Module,
    objective: Objective,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    carry: bool = True,
) -> dict[str, float]:
    """Loss, token accuracy and perplexity of a language model over a whole stream (every
    :class:`StreamBatches` batch), in eval mode; a recurrent state is carried throughout (``carry``) or reset
    every window (the context a transformer of length ``seq_len`` has)."""
    was_training = model.training
    model.eval()
    totals: dict[str, Tensor] = {}
    state = None
    for batch in StreamBatches(tokens, objective, seq_len, batch_size):
        logits, state = lm_forward(model, batch, state if carry else None)
        for key, value in token_sums(logits, batch["labels"]).items():
            totals[key] = totals.get(key, 0) + value.float()
    model.train(was_training)
    return {**objective.summarize(totals), "tokens": int(totals["num_targets"])}


def decode(
    model: Seq2SeqRNN, examples: Sequence[Example], cfg: Seq2SeqBaseline, batch_size: int
) -> list[list[int]]:
    """Greedy (``beam_size`` 1, ``pretrain.models.generation.generate``) or beam (``pretrain.models.beam_search``) outputs,
    without BOS and cut at EOS."""
    from pretrain.models.beam_search import beam_search
    from pretrain.models.generation import generate

    c = model.config
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


@torch.no_grad()
def alignment(model: Seq2SeqRNN, source: list[int], output: list[int]) -> Tensor:
    """Attention weights (len(output) + 1, len(source)) of the decoder producing ``output`` + EOS from ``source``."""
    c = model.config
    out = model(
        input_ids=torch.tensor([source]),
        decoder_input_ids=torch.tensor([[c.decoder_start_token_id, *output]]),
    )
    return out.attention[0]


def save_alignment(
    weights: Tensor, source: Sequence[str], target: Sequence[str], path: str | os.PathLike
) -> Path:
    """Heatmap of attention ``weights (T, S)``: target tokens down, source tokens across (PNG via matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("attention heatmaps need matplotlib: pip install matplotlib") from err
    if tuple(weights.shape) != (len(target), len(source)):
        raise ValueError(f"weights {tuple(weights.shape)} do not match {len(target)} x {len(source)} tokens")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(source), 1 + 0.45 * len(target)))
    image = ax.imshow(weights.float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(source)), labels=list(source), rotation=90)
    ax.set_yticks(range(len(target)), labels=list(target))
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def evaluate_seq2seq(
    model: Seq2SeqRNN, tokenizer: Tokenizer, examples: list[Example], cfg: Seq2SeqBaseline, batch_size: int
) -> dict[str, float]:
    """BLEU (sacrebleu, detokenized outputs vs reference text) and exact match of decoded outputs."""
    import sacrebleu

    if cfg.eval_examples is not None:
        examples = examples[: cfg.eval_examples]
    outputs = decode(model.eval(), examples, cfg, batch_size)
    hypotheses = [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outputs]
    references = [e.reference for e in examples]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references])
    exact = float(np.mean([o == e.target for o, e in zip(outputs, examples)]))
    return {"bleu": bleu.score, "exact_match": exact, "examples": len(examples)}


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False).strip() or tokenizer.id_to_token(i) for i in ids]


# ---------------------------------------------------------------------------------------------- runs


def _fit(
    run: RunConfig, resolved: dict[str, Any], module: BaselineModule, datamodule: L.LightningDataModule
) -> L.Trainer:
    from pretrain.training.trainer import build_trainer

    L.seed_everything(run.seed, verbose=False)
    trainer = build_trainer(run, resolved)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def _prepared(run: RunConfig, tokenizer: Tokenizer) -> list[Path]:
    return [ensure_prepared(s, tokenizer, run.data.val_fraction) for s in run.data.sources]


def _word_vocabulary(tokenizer: Tokenizer, vocab: Tensor) -> list[int]:
    """Ids to report: the vocabulary minus tokens whose string holds whitespace (not writable as word2vec text)."""
    return [
        i for i in vocab.nonzero()[:, 0].tolist() if not any(ch.isspace() for ch in tokenizer.id_to_token(i))
    ]


def run_sgns(run: RunConfig, cfg: SGNSBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    from datamodules.pretrain import PretrainDataModule

    tokenizer = ensure_tokenizer(run)
    dirs = _prepared(run, tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    objective = SkipGram(
        tokenizer,
        counts=token_counts(split_tokens(dirs, "train"), vocab_size),
        window=cfg.window,
        negatives=cfg.negatives,
        subsample=cfg.subsample,
        min_count=cfg.min_count,
        cbow=cfg.cbow,
        full_softmax=cfg.full_softmax,
        noise_power=cfg.noise_power,
        special_tokens=run.tokenizer.special_tokens,
    )
    data = PretrainDataModule(
        dirs,
        objective,
        seq_len=run.data.seq_len,
        micro_batch_size=run.data.micro_batch_size,
        weights=[s.weight for s in run.data.sources],
        num_workers=run.data.num_workers,
        seed=run.seed,
        val_batches=run.trainer.limit_val_batches,
        tokenizer=tokenizer,
    )
    model = Word2Vec(vocab_size, cfg.dim)
    trainer = _fit(run, resolved, WordVectorModule(model, run.optim, run.trainer.max_steps, objective), data)
    vectors = WordVectors.from_ids(model.vectors(), tokenizer, _word_vocabulary(tokenizer, objective.vocab))
    return {**_val_metrics(trainer), **evaluate_word_vectors(vectors, cfg.eval, Path(run.run_dir))}


def run_glove(run: RunConfig, cfg: GloVeBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    tokenizer = ensure_tokenizer(run)
    dirs = _prepared(run, tokenizer)
    objective = GloVe(
        tokenizer,
        window=cfg.window,
        min_count=cfg.min_count,
        x_max=cfg.x_max,
        alpha=cfg.alpha,
        symmetric=cfg.symmetric,
        special_tokens=run.tokenizer.special_tokens,
    )
    x = objective.count(split_tokens(dirs, "train"))
    model = GloVeModel(tokenizer.get_vocab_size(with_added_tokens=True), cfg.dim)
    module = GloVeModule(model, run.optim, run.trainer.max_steps, objective)
    trainer = _fit(run, resolved, module, CooccurrenceData(x, cfg.batch_size, run.seed))
    vectors = WordVectors.from_ids(model.vectors(), tokenizer, _word_vocabulary(tokenizer, x.vocab))
    results = {"cooccurrence_entries": len(x.values), **_val_metrics(trainer)}
    return {**results, **evaluate_word_vectors(vectors, cfg.eval, Path(run.run_dir))}


def lm_objective(run: RunConfig, tokenizer: Tokenizer, vocab_size: int) -> Objective:
    """The ``clm`` objective of the run, checked against the tokenizer (recurrent LMs need no document masks)."""
    import objectives
    from datamodules.tokenizer import check_tokenizer

    if run.objective.name != "clm":
        raise ValueError(
            f"language-model baselines train with objective clm, got objective.name={run.objective.name!r}"
        )
    options = dict(run.objective.options)
    if options.get("document_masking"):
        raise ValueError(
            "a recurrent LM carries its state across documents; set objective.options.document_masking=false"
        )
    objective = objectives.build("clm", tokenizer, **options)
    check_tokenizer(tokenizer, vocab_size, objective.required_tokens, run.tokenizer.special_tokens)
    return objective


def lm_streams(
    run: RunConfig, tokenizer: Tokenizer, validation: SourceConfig | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Train stream (train splits of data.sources) and validation stream (``validation``'s whole text, else the
    sources' val splits; None when there is none or ``limit_val_batches`` is 0)."""
    if any(s.weight != 1.0 for s in run.data.sources):
        raise ValueError("a contiguous stream cannot blend corpora by weight; set data.sources[].weight=1.0")
    dirs = _prepared(run, tokenizer)
    train = split_tokens(dirs, "train")
    if run.trainer.limit_val_batches == 0:
        return train, None
    if validation is not None:
        return train, split_tokens([ensure_prepared(validation, tokenizer, 0.0)], "train")
    return train, split_tokens(dirs, "val")


def run_rnn_lm(run: RunConfig, cfg: RNNLMBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    tokenizer = ensure_tokenizer(run)
    objective = lm_objective(run, tokenizer, cfg.model.vocab_size)
    train, val = lm_streams(run, tokenizer, cfg.validation)
    data = StreamDataModule(train, val, objective, run.data.seq_len, run.data.micro_batch_size)
    model = RNNLanguageModel(cfg.model)
    _fit(run, resolved, LanguageModelModule(model, run.optim, run.trainer.max_steps, objective), data)
    results = {
        "parameters": model.num_params(),
        "train_tokens": run.trainer.max_steps * data.train_set.streams.shape[0] * run.data.seq_len,
    }
    if val is not None:
        metrics = stream_perplexity(model, objective, val, run.data.seq_len, run.data.micro_batch_size)
        results.update({f"val/{k}": v for k, v in metrics.items()})
    return results


def run_seq2seq(run: RunConfig, cfg: Seq2SeqBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    out_dir = Path(run.run_dir)
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
    from datamodules.tokenizer import check_tokenizer

    check_tokenizer(tokenizer, cfg.model.vocab_size)
    model = Seq2SeqRNN(
        dataclasses.replace(
            cfg.model, pad_token_id=ids["pad"], eos_token_id=ids["eos"], decoder_start_token_id=ids["bos"]
        )
    )
    data = ParallelData(train, splits.get("val", []), run.data.micro_batch_size, run.seed, ids)
    trainer = _fit(run, resolved, Seq2SeqModule(model, run.optim, run.trainer.max_steps), data)
    results: dict[str, Any] = {
        "parameters": model.num_params(),
        "train_pairs": len(train),
        **_val_metrics(trainer),
    }
    for name, examples in splits.items():
        results.update(
            {f"{name}/{k}": v for k, v in evaluate_seq2seq(model, tokenizer, examples, cfg, 64).items()}
        )
    heatmaps = []
    for i, example in enumerate(splits.get("val", [])[: cfg.heatmaps]):
        output = decode(model, [example], cfg, 1)[0]
        weights = alignment(model, example.source, output)
        target = [*token_labels(tokenizer, output), "</s>"]
        path = save_alignment(
            weights, token_labels(tokenizer, example.source), target, out_dir / "alignments" / f"val-{i}.png"
        )
        heatmaps.append(str(path))
    results["heatmaps"] = heatmaps
    return results


def _val_metrics(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}


RUNS = {"sgns": run_sgns, "glove": run_glove, "rnn_lm": run_rnn_lm, "seq2seq": run_seq2seq}


def run_recipe(recipe: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate a baseline recipe; returns (and writes to ``<run_dir>/results.json``) its results."""
    run, baseline, resolved = load(recipe, overrides)
    results = {"name": run.name, "kind": baseline.kind, **RUNS[baseline.kind](run, baseline, resolved)}
    path = Path(run.run_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_json_default))
    return results


def _json_default(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


# ---------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="baseline recipe, e.g. recipes/sgns-tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. baselines.window=3")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def cmd_baseline(args: argparse.Namespace) -> int:
    """``pretrain baseline RECIPE [key=value ...]``."""
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(load(args.recipe, args.overrides)[2]), end="")
        return 0
    results = run_recipe(args.recipe, args.overrides)
    print("\n== baseline: done ==")
    for key, value in results.items():
        if isinstance(value, dict):
            value = "; ".join(
                f"{k}: {', '.join(w for w, _ in v[:5]) if isinstance(v, list) else v}"
                for k, v in value.items()
            )
        print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    return 0
