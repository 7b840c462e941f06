"""Run configuration: typed sections, recipe composition, command-line overrides and validation.

A run is described by one YAML *recipe* that lists its *pieces* and overrides some values::

    defaults: [model/gpt-tiny, objective/clm, data/shakespeare, optim/adamw, trainer/cpu, logger/default]
    name: gpt-tiny
    trainer: {max_steps: 300}

``model/gpt-tiny`` is ``configs/model/gpt-tiny.yaml`` placed under the ``model`` key. The pieces are merged in order,
then the recipe body, then ``key=value`` overrides (OmegaConf dotlist), and ``${...}`` interpolations are resolved.
The result is checked against the dataclasses below (the model section is ``pretrain.config.ModelConfig``) before
anything heavy runs: an unknown key names its path and the closest valid keys, a wrong type names the expected type.
Choices (objective, strategy, schedule, logger) come from fixed registries; nothing is imported by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"

OBJECTIVES = ("clm", "mlm", "span_corruption", "prefix_lm", "ul2")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass
class ObjectiveConfig:
    """``objectives.build(name, tokenizer, **options)``."""

    name: Literal["clm", "mlm", "span_corruption", "prefix_lm", "ul2"] = "clm"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizerConfig:
    """Where the tokenizer lives, and how ``pretrain tokenizer`` trains it when it does not exist yet."""

    path: str = "runs/tokenizers/tokenizer.json"
    train_files: list[str] = field(default_factory=list)
    vocab_size: int = 1024
    min_frequency: int = 2
    special_tokens: dict[str, str] = field(
        default_factory=dict
    )  # role -> token overrides, e.g. eos: <|endoftext|>


@dataclass
class SourceConfig:
    """One corpus: raw text files, the prepared directory ``pretrain prepare`` writes, and its blending weight."""

    name: str = "corpus"
    text: list[str] = field(default_factory=list)
    prepared: str = "runs/data/corpus"
    weight: float = 1.0


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    seq_len: int = 128  # model input length; the objective decides how many raw tokens a sample consumes
    micro_batch_size: int = 8  # per device, per forward pass
    num_workers: int = 0
    val_fraction: float = 0.05  # documents held out by `pretrain prepare`


@dataclass
class OptimConfig:
    """AdamW; the learning rate warms up linearly, then follows ``schedule`` down to ``min_lr_ratio * lr``."""

    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    schedule: Literal["cosine", "linear", "inverse_sqrt", "constant"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_steps: int | None = None  # default: trainer.max_steps


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    val_check_interval: int = 200  # optimizer steps between validations
    limit_val_batches: int = 20
    log_every_n_steps: int = 10
    compile: bool = False
    activation_checkpointing: bool = False
    progress_bar: bool = True
    throughput_window: int = 10  # optimizer steps averaged for tokens/s and MFU
    peak_flops: float | None = None  # per-device peak (FLOP/s) for MFU when the device is not in the table


@dataclass
class DDPConfig:
    find_unused_parameters: bool = False
    process_group_backend: Literal["nccl", "gloo"] | None = None  # default: nccl on GPU, gloo on CPU
    static_graph: bool = False


@dataclass
class FSDPConfig:
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    state_dict_type: Literal["full", "sharded"] = "sharded"
    cpu_offload: bool = False
    limit_all_gathers: bool = True


@dataclass
class DeepSpeedConfig:
    stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_parameters: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    allgather_bucket_size: int = 200_000_000
    reduce_bucket_size: int = 200_000_000


@dataclass
class StrategyConfig:
    name: Literal["auto", "ddp", "fsdp", "deepspeed"] = "auto"
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass
class WandbConfig:
    """Weights & Biases through Lightning's WandbLogger; offline unless a key is configured or mode=online."""

    enabled: bool = True
    project: str = "pretrain"
    name: str | None = None  # default: the run name
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: Literal["offline", "online"] | None = None  # None: online iff WANDB_API_KEY is set


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = True
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    every_n_steps: int = 200
    save_top_k: int = 2  # best by validation loss, besides `last`
    monitor: str = "val/loss"


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 1337
    run_dir: str | None = None  # default: runs/<name>
    resume: str | None = "auto"  # "auto": newest valid checkpoint in run_dir if any; a path; or None (fresh)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoints"


# ---------------------------------------------------------------------------------------------- composition


def _piece_path(ref: str, recipe_dir: Path, config_dir: Path) -> Path:
    """``model/gpt-tiny`` -> ``<config_dir>/model/gpt-tiny.yaml`` (or a path relative to the recipe)."""
    name = ref if ref.endswith((".yaml", ".yml")) else ref + ".yaml"
    for base in (recipe_dir, config_dir):
        if (base / name).is_file():
            return base / name
    group = config_dir / Path(ref).parent
    known = sorted(p.stem for p in group.glob("*.yaml")) if group.is_dir() else []
    groups = sorted(p.name for p in config_dir.iterdir() if p.is_dir()) if config_dir.is_dir() else []
    raise FileNotFoundError(
        f"config piece {ref!r} not found in {config_dir} or {recipe_dir}"
        + (f"; pieces in {Path(ref).parent}/: {known}" if known else f"; groups: {groups}")
    )


def compose(
    recipe: str | Path, overrides: list[str] | None = None, config_dir: Path = CONFIG_DIR
) -> dict[str, Any]:
    """Merge the recipe's pieces (from ``config_dir``), its body and ``key=value`` overrides; return the resolved
    plain dict."""
    recipe = Path(recipe)
    if not recipe.is_file():
        ready = sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("recipes/*.yaml"))
        raise FileNotFoundError(f"recipe {recipe} not found; ready recipes: {ready}")
    try:
        body = OmegaConf.load(recipe)
        pieces = []
        for ref in body.pop("defaults", []) or []:
            group = Path(ref).parts[0]
            pieces.append(
                OmegaConf.create({group: OmegaConf.load(_piece_path(ref, recipe.parent, config_dir))})
            )
        merged = OmegaConf.merge(*pieces, body)
        for item in overrides or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(
                    f"override {item!r} is not of the form key=value (e.g. trainer.max_steps=100)"
                )
            # the value is parsed as in YAML (numbers, lists, null); `a.b.0.c=` addresses list items
            OmegaConf.update(merged, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
        return OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, TypeError) as err:
        raise ValueError(f"cannot compose {recipe}: {err}") from err


# ---------------------------------------------------------------------------------------------- validation


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` converted to ``tp`` (dataclasses built recursively); ``ValueError`` naming ``path`` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, path)
            except ValueError:
                continue
        raise ValueError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value in args or (isinstance(value, int) and str(value) in args):
            return value if value in args else str(value)
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{path}: {value!r} is not one of {list(args)}{hint}")
    if dataclasses.is_dataclass(tp):
        return structured(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return [_check(v, args[0] if args else Any, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return {k: _check(v, args[1] if args else Any, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML reads an unquoted `32` as a number
    else:
        raise TypeError(f"{path}: unsupported schema type {tp!r}")
    raise ValueError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def structured(cls: type, node: Any, path: str = "") -> Any:
    """Dataclass ``cls`` from a plain dict, every key and type checked (see the module docstring)."""
    if not isinstance(node, dict):
        raise ValueError(f"{path or 'config'}: expected a mapping of {cls.__name__} fields, got {node!r}")  # noqa: TRY004
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in node:
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3, cutoff=0.5)
            where = f"{path}.{key}" if path else str(key)
            hint = f"; did you mean {' / '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown config key {key!r} at {where}{hint} (valid keys of {path or 'the run'}: {sorted(fields)})"
            )
    kwargs = {k: _check(v, hints[k], f"{path}.{k}" if path else k) for k, v in node.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path or 'config'}: {err}") from err


def validate(raw: dict[str, Any]) -> RunConfig:
    """Typed ``RunConfig`` from a resolved dict, with cross-field checks."""
    run = structured(RunConfig, raw)
    if run.run_dir is None:
        run.run_dir = f"runs/{run.name}"
    t = run.trainer
    if t.precision in ("32", "16", "bf16"):
        t.precision = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}[t.precision]
    if t.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision: {t.precision!r} is not one of {list(PRECISIONS)}")
    for name in (
        "max_steps",
        "devices",
        "num_nodes",
        "accumulate_grad_batches",
        "val_check_interval",
        "log_every_n_steps",
    ):
        if getattr(t, name) < 1:
            raise ValueError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    if run.data.micro_batch_size < 1 or run.data.seq_len < 1:
        raise ValueError("data.micro_batch_size and data.seq_len must be >= 1")
    if run.data.seq_len > run.model.max_seq_len:
        raise ValueError(
            f"data.seq_len={run.data.seq_len} exceeds model.max_seq_len={run.model.max_seq_len}; "
            "lower data.seq_len or raise model.max_seq_len"
        )
    if not run.data.sources:
        raise ValueError("data.sources is empty; list at least one corpus")
    if run.strategy.name == "deepspeed" and run.trainer.compile:
        raise ValueError(
            "trainer.compile is not supported with strategy deepspeed; set trainer.compile=false"
        )
    return run


def load(recipe: str | Path, overrides: list[str] | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """Compose, resolve and validate a recipe: ``(typed config, resolved plain dict)``."""
    raw = compose(recipe, overrides)
    run = validate(raw)
    return run, to_dict(run)


def to_dict(run: RunConfig) -> dict[str, Any]:
    """The fully resolved config as plain Python (saved in checkpoints and logged to W&B)."""
    return dataclasses.asdict(run)


def from_dict(resolved: dict[str, Any]) -> RunConfig:
    return validate(resolved)


def global_batch_size(run: RunConfig, world_size: int) -> int:
    """Samples per optimizer step: micro batch x accumulation x data-parallel ranks."""
    return run.data.micro_batch_size * run.trainer.accumulate_grad_batches * world_size
