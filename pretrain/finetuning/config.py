"""The ``pretrain finetune`` recipe schema: where the backbone comes from, the head, freezing, data files,
metrics, optimizer, trainer and text-to-text decoding; ``load_config`` composes and validates a recipe.

A finetuning recipe (``recipes/finetune-*.yaml``) composes pieces from ``configs/finetune/<group>/<name>.yaml``::

    defaults: [init/minilm, data/sst2, optim/bert-finetune]
    name: finetune-sst2-minilm
    trainer: {max_steps: 2000, max_time_minutes: 8}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pretrain.config import CONFIG_DIR, OptimConfig, compose, structured
from pretrain.config.compose import check_run_name
from pretrain.config.run import (
    PRECISIONS,
    CheckpointConfig,
    FinetuneResumeChange,
    GuardsConfig,
    LoggerConfig,
    StrategyConfig,
    TrainerConfig,
    WandbConfig,
    check_checkpoint,
    check_optim,
    muon_problems,
    shared_problems,
)
from pretrain.errors import InputError
from pretrain.models.config import BLOCK_LINEARS, ModelConfig

FINETUNE_CONFIGS = CONFIG_DIR / "finetune"


@dataclass
class InitConfig:
    """Where the backbone comes from: ``checkpoint`` (our ``.ckpt`` or a Hugging Face directory), or random weights
    of ``model`` when ``checkpoint`` is null. ``tokenizer`` overrides (or, for random init, supplies) the tokenizer."""

    checkpoint: str | None = None
    tokenizer: str | None = None
    model: ModelConfig | None = None


def check_init_checkpoint(init: InitConfig) -> None:
    """``init.checkpoint``, when set, exists (a local ``.ckpt``, sharded or Hugging Face directory)."""
    if init.checkpoint is not None and not Path(init.checkpoint).expanduser().exists():
        raise FileNotFoundError(
            f"init.checkpoint {init.checkpoint} not found (a .ckpt from `pretrain fit`, or a Hugging Face directory)"
        )


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
class LoRAConfig:
    """LoRA through ``peft`` (``pretrain.finetuning.lora``): rank ``r``, scale ``alpha / r``, dropout on the
    adapter's input, and the block linears adapted (names of ``pretrain.models.transformer``: ``q``, ``k``, ``v``,
    ``out`` (self- and cross-attention), ``gate`` (GLU MLPs), ``fc``, ``proj``). The rest of the backbone is frozen."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(BLOCK_LINEARS))


@dataclass
class FinetuneDataConfig:
    """Files and encoding. Classification/regression: GLUE-style TSV/JSONL (``pretrain.datamodules.finetune``). Text-to-text:
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
    # pack each batch's examples into rows without padding, kept apart by document masks (sequence heads; the
    # teacher-forced text-to-text loss): the padded path's losses and metrics, computed on the real tokens only
    unpadded: bool = True


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
class FinetuneConfig:
    name: str = "finetune"
    seed: int = 1234
    run_dir: str | None = None  # default runs/<name> (load_config sets it; read it as run_path)
    init: InitConfig = field(default_factory=InitConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lora: LoRAConfig | None = None  # low-rank adapters instead of training the whole backbone
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    metrics: list[str] | None = (
        None  # None: GLUE's metrics for data.task, accuracy / pearson+spearman otherwise
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    # the Trainer sections of `pretrain fit` (pretrain.config.run), built by the same build_trainer
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(limit_val_batches=None))
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(wandb=WandbConfig(enabled=False)))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(save_top_k=0))
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    resume: str | None = "auto"  # "auto": the newest valid checkpoint in run_dir/checkpoints; a path; None
    # resume although these differ from the checkpoint's (the warning says what happens; docs/resume.md)
    resume_allow: list[FinetuneResumeChange] = field(default_factory=list)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    save: bool = True  # write <run_dir>/finetuned.pt (weights, config, tokenizer, label names)

    @property
    def run_path(self) -> Path:
        """``run_dir``, set once the config is validated."""
        assert self.run_dir is not None, "run_dir is set when the config is validated"
        return Path(self.run_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_path / "checkpoints"


def validate(raw: dict[str, Any]) -> FinetuneConfig:
    """Typed config with cross-field checks (unknown keys and wrong types name their path)."""
    cfg = structured(FinetuneConfig, _with_finetune_defaults(raw))
    check_run_name(cfg.name)
    cfg.run_dir = cfg.run_dir or f"runs/{cfg.name}"
    if cfg.init.checkpoint is None and (cfg.init.model is None or cfg.init.tokenizer is None):
        raise InputError(
            "init: give init.checkpoint (a .ckpt or Hugging Face directory), or init.model and "
            "init.tokenizer for a randomly initialised backbone"
        )
    if cfg.init.checkpoint is not None and cfg.init.model is not None:
        raise InputError("init.model is only for random initialisation; drop it or set init.checkpoint=null")
    if not cfg.data.train_file:
        raise InputError("data.train_file is empty; point it at a TSV/JSONL (or text) training file")
    if cfg.decoding.early_stopping not in (True, False, "never"):
        raise InputError(
            f"decoding.early_stopping must be true, false or never, got {cfg.decoding.early_stopping!r}"
        )
    if cfg.head.kind == "text2text" and cfg.head.lr is not None:
        raise InputError("head.lr does not apply to text2text (the LM head is part of the backbone); drop it")
    if cfg.head.kind in ("token", "multiple_choice"):
        raise InputError(
            f"head.kind={cfg.head.kind!r} has no file datamodule in `pretrain finetune` yet (GLUE files are "
            "sentence-level); use pretrain.models.heads.TaskModel with FinetuneModule from Python"
        )
    _check_training(cfg)
    if cfg.lora is not None:
        _check_lora(cfg, cfg.lora)
    if cfg.freeze.layers < 0:
        raise InputError(f"freeze.layers must be >= 0, got {cfg.freeze.layers}")
    if problems := _data_and_decoding_problems(cfg):
        raise InputError("; ".join(problems))
    return cfg


def _data_and_decoding_problems(cfg: FinetuneConfig) -> list[str]:
    """Bounds of ``data`` and ``decoding`` (checked here, named as recipe keys, rather than by the datamodule or
    the decoder under their Python names, after the backbone is loaded)."""
    d, g = cfg.data, cfg.decoding
    checks = [
        ("seed", cfg.seed, 0 <= cfg.seed < 2**32, "in [0, 2**32) (numpy's seeds)"),
        ("data.micro_batch_size", d.micro_batch_size, d.micro_batch_size >= 1, ">= 1"),
        ("data.num_workers", d.num_workers, d.num_workers >= 0, ">= 0"),
        ("data.max_length", d.max_length, d.max_length >= 2, ">= 2 (a token and an end token)"),
        ("data.max_target_length", d.max_target_length, d.max_target_length >= 2, ">= 2 (a token and EOS)"),
        ("decoding.max_new_tokens", g.max_new_tokens, g.max_new_tokens >= 1, ">= 1"),
        ("decoding.temperature", g.temperature, g.temperature > 0, "> 0"),
        ("decoding.top_k", g.top_k, g.top_k is None or g.top_k >= 1, ">= 1 or null"),
        ("decoding.top_p", g.top_p, g.top_p is None or 0 < g.top_p <= 1, "in (0, 1] or null"),
        ("decoding.num_beams", g.num_beams, g.num_beams >= 1, ">= 1"),
    ]
    return [f"{key} must be {bound}, got {value}" for key, value, ok, bound in checks if not ok]


OWN_DEFAULTS = (
    "trainer",
    "logger",
    "checkpoint",
)  # sections of `pretrain fit` with finetuning's own defaults


def _with_finetune_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the sections whose defaults differ from `pretrain fit`'s (``FinetuneConfig``'s factories:
    the whole validation file, no W&B, no best-k checkpoints) filled in below what it sets."""

    def merged(base: dict[str, Any], given: Any) -> Any:
        if not isinstance(given, dict):
            return given
        return base | {
            k: merged(base[k], v) if isinstance(base.get(k), dict) else v for k, v in given.items()
        }

    defaults = FinetuneConfig()
    return raw | {
        s: merged(dataclasses.asdict(getattr(defaults, s)), raw[s]) for s in OWN_DEFAULTS if s in raw
    }


# Trainer settings `pretrain fit` applies to its model (``PretrainModule``), not through the Trainer finetuning shares
FIT_ONLY = ("compile", "activation_checkpointing", "float8")


def _check_training(cfg: FinetuneConfig) -> None:
    """The Trainer sections (shared with `pretrain fit`) as finetuning uses them."""
    check_optim(cfg.optim)
    if problems := shared_problems(cfg.trainer, cfg.checkpoint):
        raise InputError(problems[0])
    check_checkpoint(cfg.checkpoint)
    t = cfg.trainer
    names = ("max_steps", "val_check_interval", "log_every_n_steps", "devices", "num_nodes")
    for name in (*names, "accumulate_grad_batches"):
        if getattr(t, name) < 1:
            raise InputError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    if t.precision not in PRECISIONS:
        raise InputError(f"trainer.precision: {t.precision!r} is not one of {list(PRECISIONS)}")
    for name in FIT_ONLY:
        if getattr(t, name):
            raise InputError(
                f"trainer.{name} is a `pretrain fit` option; `pretrain finetune` does not apply it: drop it"
            )
    if problems := muon_problems(cfg.optim, cfg.strategy.name):
        raise InputError(problems[0])
    if cfg.strategy.name == "deepspeed" and cfg.guards.spike.enabled:
        raise InputError("guards.spike is not supported with strategy deepspeed; use strategy ddp / fsdp")
    if (
        cfg.strategy.tensor_parallel != 1
        or cfg.strategy.sequence_parallel
        or cfg.strategy.context_parallel != 1
    ):
        raise InputError(
            "strategy.tensor_parallel / sequence_parallel / context_parallel split a pretraining model "
            "(`pretrain fit`); finetuning runs data-parallel: drop them"
        )


def _check_lora(cfg: FinetuneConfig, lora: LoRAConfig) -> None:
    if lora.r < 1 or not lora.alpha > 0 or not 0 <= lora.dropout < 1:
        raise InputError(
            f"lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, got r={lora.r}, alpha={lora.alpha}, "
            f"dropout={lora.dropout}"
        )
    if not lora.target_modules:
        raise InputError("lora.target_modules is empty; name the block linears to adapt, e.g. [q, v]")
    if cfg.freeze.embeddings or cfg.freeze.layers:
        raise InputError("freeze does not apply with lora (LoRA freezes the whole backbone); drop freeze.*")


def load_config(recipe: str | Path, overrides: list[str] | None = None) -> FinetuneConfig:
    """Compose a recipe from ``configs/finetune`` pieces (``defaults: [init/minilm, data/sst2, ...]``), its body and
    ``key=value`` overrides (``pretrain.config.compose``), then validate."""
    return validate(compose(recipe, overrides, config_dir=FINETUNE_CONFIGS))
