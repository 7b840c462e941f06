"""The ``baselines`` section of a baseline recipe: one dataclass per kind, and ``load_config`` composing and
validating a recipe (shared run sections through ``pretrain.config``, the section through ``structured``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pretrain import config
from pretrain.config import RunConfig, SourceConfig
from pretrain.config.compose import check_counts
from pretrain.errors import InputError
from pretrain.models.rnn_config import RNNConfig, Seq2SeqConfig


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
            raise InputError(
                f"toy_max_length ({self.toy_max_length}) must be >= toy_min_length ({self.toy_min_length})"
            )
        if self.task == "parallel" and len(self.train) != 2:
            raise InputError(f"task=parallel needs train=[source file, target file], got {self.train}")


BASELINES = {
    "sgns": SGNSBaseline,
    "glove": GloVeBaseline,
    "rnn_lm": RNNLMBaseline,
    "seq2seq": Seq2SeqBaseline,
}

READS = {"sgns": set(), "glove": set(), "rnn_lm": {"objective"}, "seq2seq": set()}  # of model and objective


def load_config(
    recipe: str | Path, overrides: list[str] | None = None
) -> tuple[RunConfig, Any, dict[str, Any]]:
    """Compose and validate a baseline recipe: ``(shared run config, baseline section, resolved dict)``."""
    raw = config.compose(recipe, overrides)
    section = raw.pop("baselines", None)
    if not isinstance(section, dict) or section.get("kind") not in BASELINES:
        raise InputError(
            f"{recipe}: a baseline recipe needs a section `baselines` with kind in {list(BASELINES)} "
            f"(pieces in configs/baselines/), got {section!r:.80}"
        )
    kind = section["kind"]
    unread = sorted(key for key in ("model", "objective") if key in raw and key not in READS[kind])
    if unread:
        named = [leaf for key in unread for leaf in _leaves(raw[key]) if leaf in section]
        example = named[0] if named else next(key for key in section if key != "kind")
        raise InputError(
            f"{', '.join(unread)}: a {kind} baseline has no such section (its settings are under `baselines`, "
            f"e.g. baselines.{example}); drop it from the recipe or the overrides"
        )
    run = config.validate(raw)
    baseline = config.structured(BASELINES[kind], section, "baselines")
    if run.trainer.devices != 1 or run.trainer.num_nodes != 1:
        raise InputError("baselines train on one device; set trainer.devices=1 trainer.num_nodes=1")
    if run.strategy.name in ("fsdp", "deepspeed"):
        raise InputError(
            f"strategy.name={run.strategy.name}: baselines train on one device, with nothing to shard; "
            "drop the strategy (strategy.name=auto)"
        )
    resolved = {k: v for k, v in config.to_dict(run).items() if k not in ("model", "resume")}  # unused here
    return run, baseline, {**resolved, "baselines": dataclasses.asdict(baseline)}


def _leaves(node: Any) -> list[str]:
    """The key names under ``node`` (a composed section), depth first."""
    if not isinstance(node, dict):
        return []
    return [name for key, value in node.items() for name in (key, *_leaves(value))]
