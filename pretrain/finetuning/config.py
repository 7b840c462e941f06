"""The ``pretrain finetune`` recipe schema: where the backbone comes from, the head, freezing, data files,
metrics, optimizer, trainer and text-to-text decoding; ``load_config`` composes and validates a recipe.

A finetuning recipe (``recipes/finetune-*.yaml``) composes pieces from ``configs/finetune/<group>/<name>.yaml``::

    defaults: [init/minilm, data/sst2, optim/bert-finetune]
    name: finetune-sst2-minilm
    trainer: {max_steps: 2000, max_time_minutes: 8}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pretrain.config import CONFIG_DIR, OptimConfig, compose, structured
from pretrain.config.compose import check_run_name
from pretrain.config.run import DDPConfig
from pretrain.models.config import ModelConfig

FINETUNE_CONFIGS = CONFIG_DIR / "finetune"


@dataclass
class InitConfig:
    """Where the backbone comes from: ``checkpoint`` (our ``.ckpt`` or a Hugging Face directory), or random weights
    of ``model`` when ``checkpoint`` is null. ``tokenizer`` overrides (or, for random init, supplies) the tokenizer."""

    checkpoint: str | None = None
    tokenizer: str | None = None
    model: ModelConfig | None = None


@dataclass
class HeadConfig:
    kind: Literal["sequence", "token", "multiple_choice", "text2text"] = "sequence"
    pooling: Literal["first", "last", "mean", "pooler"] | None = (
        None  # None: pretrain.models.heads.default_pooling
    )
    dropout: float = 0.1
    lr: float | None = None  # head learning rate (default optim.lr)


@dataclass
class FreezeConfig:
    embeddings: bool = False
    layers: int = 0  # the lowest `layers` blocks of every stack


@dataclass
class FinetuneDataConfig:
    """Files and encoding. Classification/regression: GLUE-style TSV/JSONL (``datamodules.finetune``). Text-to-text:
    a GLUE file rendered as text (``task``), or line-aligned ``train_file`` / ``train_target_file`` (e.g. Multi30k)."""

    task: str | None = None  # GLUE task name: column defaults, text-to-text format, default metrics
    train_file: str = ""
    val_file: str | None = None
    train_target_file: str | None = None
    val_target_file: str | None = None
    source_prefix: str = ""  # text-to-text, parallel files: e.g. "translate German to English: "
    text_columns: list[str] | None = None
    label_column: str | None = None
    regression: bool | None = None
    header: bool | None = None
    template: str | None = None  # TemplateProcessing string; default per architecture (see default_template)
    special_tokens: dict[str, str] = field(default_factory=dict)  # role -> token overrides
    max_length: int = 128  # source tokens (text-to-text) or whole example
    max_target_length: int = 32
    micro_batch_size: int = 32
    num_workers: int = 0


@dataclass
class DecodingConfig:
    """Text-to-text validation decoding (all strategies use the KV cache)."""

    strategy: Literal["greedy", "sample", "beam"] = "greedy"
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never" (transformers' semantics)


@dataclass
class FinetuneTrainerConfig:
    max_steps: int = 1000
    max_time_minutes: float | None = None  # wall-clock budget for training (then the final evaluation runs)
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = "auto"
    devices: int = 1  # data-parallel processes per node (data.micro_batch_size each)
    num_nodes: int = 1
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    val_check_interval: int = 200  # optimizer steps between (possibly partial) validations
    limit_val_batches: int | None = None  # during training; the final evaluation always reads the whole file
    log_every_n_steps: int = 10
    progress_bar: bool = True  # a bar on a terminal; elsewhere (log file, CI, SLURM) a line every progress_seconds
    progress_seconds: float = 30.0


@dataclass
class FinetuneStrategyConfig:
    """How ``trainer.devices`` x ``trainer.num_nodes`` processes train: ``auto`` (DDP when there are several)
    or ``ddp`` with its options (``process_group_backend``: nccl on GPUs, gloo on the CPU by default)."""

    name: Literal["auto", "ddp"] = "auto"
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class FinetuneConfig:
    name: str = "finetune"
    seed: int = 1234
    run_dir: str | None = None  # default runs/<name>
    init: InitConfig = field(default_factory=InitConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    metrics: list[str] | None = (
        None  # None: GLUE's metrics for data.task, accuracy / pearson+spearman otherwise
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: FinetuneTrainerConfig = field(default_factory=FinetuneTrainerConfig)
    strategy: FinetuneStrategyConfig = field(default_factory=FinetuneStrategyConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    save: bool = True  # write <run_dir>/finetuned.pt (weights, config, tokenizer, label names)


def validate(raw: dict[str, Any]) -> FinetuneConfig:
    """Typed config with cross-field checks (unknown keys and wrong types name their path)."""
    cfg = structured(FinetuneConfig, raw)
    check_run_name(cfg.name)
    cfg.run_dir = cfg.run_dir or f"runs/{cfg.name}"
    if cfg.init.checkpoint is None and (cfg.init.model is None or cfg.init.tokenizer is None):
        raise ValueError(
            "init: give init.checkpoint (a .ckpt or Hugging Face directory), or init.model and "
            "init.tokenizer for a randomly initialised backbone"
        )
    if cfg.init.checkpoint is not None and cfg.init.model is not None:
        raise ValueError("init.model is only for random initialisation; drop it or set init.checkpoint=null")
    if not cfg.data.train_file:
        raise ValueError("data.train_file is empty; point it at a TSV/JSONL (or text) training file")
    if cfg.decoding.early_stopping not in (True, False, "never"):
        raise ValueError(
            f"decoding.early_stopping must be true, false or never, got {cfg.decoding.early_stopping!r}"
        )
    if cfg.head.kind == "text2text" and cfg.head.lr is not None:
        raise ValueError("head.lr does not apply to text2text (the LM head is part of the backbone); drop it")
    if cfg.head.kind in ("token", "multiple_choice"):
        raise ValueError(
            f"head.kind={cfg.head.kind!r} has no file datamodule in `pretrain finetune` yet (GLUE files are "
            "sentence-level); use pretrain.models.heads.TaskModel with FinetuneModule from Python"
        )
    for name in ("max_steps", "val_check_interval", "log_every_n_steps", "devices", "num_nodes"):
        if getattr(cfg.trainer, name) < 1:
            raise ValueError(f"trainer.{name} must be >= 1, got {getattr(cfg.trainer, name)}")
    if cfg.freeze.layers < 0:
        raise ValueError(f"freeze.layers must be >= 0, got {cfg.freeze.layers}")
    return cfg


def load_config(recipe: str | Path, overrides: list[str] | None = None) -> FinetuneConfig:
    """Compose a recipe from ``configs/finetune`` pieces (``defaults: [init/minilm, data/sst2, ...]``), its body and
    ``key=value`` overrides (``pretrain.config.compose``), then validate."""
    return validate(compose(recipe, overrides, config_dir=FINETUNE_CONFIGS))
