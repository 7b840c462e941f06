"""The pretraining run's schema (``RunConfig``: typed sections) and its cross-field checks.

Recipes compose and validate through ``pretrain.config.compose``; the model section is
``pretrain.models.config.ModelConfig``. Choices (objective, strategy, schedule, logger) are closed literals.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard

from pretrain.config.compose import check_run_name, check_type, compose, shared_data, structured
from pretrain.datamodules.corpus import document_mode
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig
from pretrain.parallel.mesh import parallel_problems

if TYPE_CHECKING:
    from pretrain.datamodules.prepare import CorpusSettings

ObjectiveName = Literal["clm", "mlm", "span_corruption", "prefix_lm", "ul2"]  # the pretraining objectives
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]  # PRECISIONS as a type (Lightning's)


def is_precision(value: str) -> TypeGuard[Precision]:
    """Whether ``value`` is one of ``PRECISIONS`` (validation refuses any other ``trainer.precision``)."""
    return value in PRECISIONS


# what a resume may find changed when resume_allow lists it (pretrain.training.setup.FIT_RESUME,
# pretrain.finetuning.checkpoint.FINETUNE_RESUME)
ResumeChange = Literal["tokenizer", "data", "objective", "optimizer", "lr_schedule", "data_schedule", "batch"]
FinetuneResumeChange = Literal["data", "optimizer", "lr_schedule"]


@dataclass
class ObjectiveConfig:
    """``pretrain.objectives.build(name, tokenizer, **options)``."""

    name: ObjectiveName = "clm"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizerConfig:
    """Where the tokenizer lives, and how ``pretrain tokenizer`` trains it when it does not exist yet."""

    path: str = "runs/tokenizers/tokenizer.json"
    train_files: list[str] = field(default_factory=list)
    vocab_size: int = 1024
    min_frequency: int = 2
    on_invalid_utf8: Literal["error", "replace", "skip"] = "error"  # lines of train_files that are not UTF-8
    special_tokens: dict[str, str] = field(
        default_factory=dict
    )  # role -> token overrides, e.g. eos: <|endoftext|>


@dataclass
class SourceConfig:
    """One corpus: raw text files, how they are cut into documents, the prepared directory ``pretrain prepare``
    writes, and its blending weight.

    ``document`` is the source's document convention (``pretrain.datamodules.corpus``): ``file`` (whole file, paragraph
    breaks kept), ``line``, ``blank_line`` (each paragraph a document; the break becomes EOS) or
    ``separator:S`` (documents end at lines equal to S; paragraph breaks inside documents kept). JSONL /
    Parquet / ``datasets`` inputs: one record per document, its ``text_field``."""

    name: str = "corpus"
    text: list[str] = field(default_factory=list)
    prepared: str = "runs/data/corpus"
    weight: float = 1.0
    document: str = "blank_line"
    text_field: str = "text"
    dedup: Literal["none", "exact"] = "none"  # exact: drop documents whose text repeats an earlier one


@dataclass
class PhaseConfig:
    """From optimizer step ``start`` on, sample the sources by ``weights`` (source name -> weight, summing to 1;
    a source left out has weight 0)."""

    start: int = 0
    weights: dict[str, float] = field(default_factory=dict)


@dataclass
class ScheduleConfig:
    """A mixture that changes over training (``pretrain.datamodules.schedule``): no phases keeps ``sources[].weight`` for
    the whole run; with phases, the first starts at step 0, ``constant`` holds each phase's weights until the
    next, ``linear`` moves from one phase's weights to the next's step by step."""

    phases: list[PhaseConfig] = field(default_factory=list)
    interpolation: Literal["constant", "linear"] = "constant"


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    seq_len: int = 128  # model input length; the objective decides how many raw tokens a sample consumes
    micro_batch_size: int = 8  # per device, per forward pass
    num_workers: int = 0
    val_fraction: float = 0.05  # documents held out by `pretrain prepare`
    on_invalid_utf8: Literal["error", "replace", "skip"] = "error"  # lines that are not UTF-8 (prepare)
    # every objective keeps the documents packed into a sample apart (attention, positions, per-document noise)
    document_mask: bool = True


@dataclass
class MuonConfig:
    """``torch.optim.Muon`` settings for the hidden weight matrices when ``optim.name`` is ``muon``
    (``pretrain.optim.param_groups`` lists the rule); the schedule scales this LR like AdamW's."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    weight_decay: float = 0.0  # decoupled: W <- W (1 - lr wd)
    adjust_lr: Literal["original", "match_rms_adamw"] = (
        "original"  # lr * sqrt(max(1, out/in)) | 0.2 sqrt(max)
    )
    # Newton-Schulz in bfloat16 (torch's own: fast on GPUs and CPUs with native bf16 matmuls) or float32 (CPUs
    # without, e.g. AVX2-only, where emulated bf16 matmuls are ~12x slower); auto picks by the parameters' device
    # (pretrain.compat.muon)
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"


@dataclass
class OptimConfig:
    """AdamW (or Muon for hidden matrices + AdamW for the rest, ``name: muon``); the learning rate warms up
    linearly, then follows ``schedule`` down to ``min_lr_ratio * lr``. ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are AdamW's."""

    name: Literal["adamw", "muon"] = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    # wsd: warmup, constant, then linear to the floor over the last ``cooldown_fraction`` of decay_steps
    schedule: Literal["cosine", "linear", "inverse_sqrt", "constant", "wsd"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_steps: int | None = None  # default: trainer.max_steps
    cooldown_fraction: float = 0.2  # wsd only


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
    limit_val_batches: int | None = 20  # None: the whole validation set
    max_time_minutes: float | None = (
        None  # wall-clock budget for training (then the run ends as at max_steps)
    )
    log_every_n_steps: int = 10
    compile: bool = False
    activation_checkpointing: bool = False
    # a bar on a terminal; elsewhere (log file, CI, SLURM) a line every progress_seconds
    progress_bar: bool = True
    progress_seconds: float = 30.0
    throughput_window: int = 10  # optimizer steps averaged for tokens/s and MFU
    peak_flops: float | None = None  # per-device peak (FLOP/s) for MFU when the device is not in the table
    float8: bool = False  # float8 matmuls in the blocks' linears (torchao; CUDA compute capability >= 8.9)
    sync_check: Literal["off", "warn", "error"] = "off"  # host-device syncs on steps that do not log
    # automatic GC off during fit, gc.collect(1) every N optimizer steps (torchtitan); 0 or null: Python's GC
    gc_every_n_steps: int | None = 50
    # glibc keeps freed host memory for the next step instead of faulting it in again (training/host_memory.py)
    reuse_host_memory: bool = True


@dataclass
class DDPConfig:
    find_unused_parameters: bool = False
    process_group_backend: Literal["nccl", "gloo"] | None = None  # default: nccl on GPU, gloo on CPU
    static_graph: bool = False


@dataclass
class FSDPConfig:
    """FSDP2 ``fully_shard`` per block: FULL_SHARD reshards parameters after forward, SHARD_GRAD_OP keeps them
    gathered until backward, HYBRID_SHARD shards within a node and replicates across nodes (NO_SHARD: use DDP)."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    state_dict_type: Literal["full", "sharded"] = "sharded"
    cpu_offload: bool = False


@dataclass
class DeepSpeedConfig:
    stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_parameters: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    allgather_bucket_size: int = 200_000_000
    reduce_bucket_size: int = 200_000_000
    # ZeRO-3 keeps parameters with fewer elements than this whole on every rank (DeepSpeed's
    # stage3_param_persistence_threshold); 0 partitions all of them
    param_persistence_threshold: int = 100_000


@dataclass
class StrategyConfig:
    name: Literal["auto", "ddp", "fsdp", "deepspeed"] = "auto"
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # ranks that split every layer (heads, MLP width, vocabulary; DTensor, strategy fsdp only): trainer.devices
    # = data-parallel ranks x tensor_parallel per node (pretrain.parallel.mesh)
    tensor_parallel: int = 1
    sequence_parallel: bool = False  # with tensor_parallel: norms and dropout on a slice of the sequence
    # ranks that split every sequence (load-balanced chunks, K/V all-gathered; strategy fsdp only): trainer.devices
    # = data-parallel ranks x context_parallel x tensor_parallel per node (pretrain.parallel.context)
    context_parallel: int = 1


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
    # <run_dir>/curves.png drawn from the CSV log at the end of a fit (~1.4 CPU-s of matplotlib)
    curves: bool = True


@dataclass
class CheckpointConfig:
    every_n_steps: int = 200
    save_top_k: int = 2  # best by `monitor`, besides `last`; 0: none, -1: every validation's (as Lightning)
    monitor: str = "val/loss"
    mode: Literal["min", "max"] | None = (
        None  # None: from the metric's name (loss, ppl: min; accuracy, f1: max)
    )
    # write checkpoints in the background (torch.distributed.checkpoint directories; training goes on meanwhile)
    async_save: bool = False
    # share of the wall clock the background write keeps the storage busy (paced: a write takes ~1/share as long
    # as alone, and takes that much less from the training); 1: as fast as it can
    async_write_share: float = 0.25


LOWER_IS_BETTER = frozenset({"loss", "ppl", "perplexity", "nll", "bpb", "bpc", "error", "err", "wer", "cer"})
HIGHER_IS_BETTER = frozenset(
    {
        "accuracy",
        "acc",
        "f1",
        "mcc",
        "bleu",
        "exact_match",
        "em",
        "rouge",
        "auc",
        "pearson",
        "spearman",
        "precision",
        "recall",
        "correlation",
    }
)


ASYNC_DEEPSPEED = (
    "checkpoint.async_save=true is not supported with strategy deepspeed (its engine writes its own checkpoint "
    "files in the training step; DeepSpeed's decoupled writer needs its async_io op: CUDA and libaio); use "
    "strategy.name=fsdp or ddp, or checkpoint.async_save=false"
)


def shared_problems(t: TrainerConfig, c: CheckpointConfig) -> list[str]:
    """Bounds of the ``trainer`` and ``checkpoint`` fields that `pretrain fit` and `pretrain finetune` check
    alike, one line each."""
    problems = []
    if (t.gc_every_n_steps or 0) < 0:
        problems.append(
            f"trainer.gc_every_n_steps must be >= 0 (0 or null: Python's automatic GC), got {t.gc_every_n_steps}"
        )
    if c.every_n_steps < 1:
        problems.append(f"checkpoint.every_n_steps must be >= 1, got {c.every_n_steps}")
    if not 0 < c.async_write_share <= 1:
        problems.append(
            f"checkpoint.async_write_share must be in (0, 1] (1: write as fast as the storage takes it), "
            f"got {c.async_write_share}"
        )
    if c.save_top_k < -1:
        problems.append(
            f"checkpoint.save_top_k must be >= -1 (0: no best checkpoints, -1: every validation's), "
            f"got {c.save_top_k}"
        )
    return problems


def corpus_settings(run: RunConfig, source: SourceConfig) -> CorpusSettings:
    """The settings that shape ``source``'s prepared corpus (``pretrain prepare`` writes it with them, a fit checks
    it is still what they give)."""
    return {
        "val_fraction": run.data.val_fraction,
        "document": source.document,
        "text_field": source.text_field,
        "on_invalid_utf8": run.data.on_invalid_utf8,
        "eos_token": run.tokenizer.special_tokens.get("eos"),
        "dedup": source.dedup,
    }


def check_resume_path(run: TrainingRun) -> None:
    """``resume``, when a path, names a checkpoint that exists."""
    if run.resume not in (None, "auto") and not Path(run.resume).exists():
        raise FileNotFoundError(f"resume={run.resume}: no such checkpoint (use resume=auto or resume=null)")


def check_checkpoint(c: CheckpointConfig) -> None:
    """``checkpoint.mode`` set when unset, from the monitored metric's name; ValueError when the name does not
    tell whether higher or lower is better."""
    if c.mode is not None or c.save_top_k == 0:
        return
    leaf = c.monitor.rsplit("/", 1)[-1].lower()
    words = {leaf, *leaf.replace("-", "_").split("_")}
    lower, higher = bool(words & LOWER_IS_BETTER), bool(words & HIGHER_IS_BETTER)
    if lower == higher:
        raise InputError(
            f"checkpoint.mode: cannot tell from the name whether a higher or lower {c.monitor!r} is better; set "
            "checkpoint.mode=max or checkpoint.mode=min"
        )
    c.mode = "min" if lower else "max"


@dataclass
class NonFiniteGuardConfig:
    """A step whose loss or gradient norm is NaN/Inf is not applied; ``max_consecutive`` in a row roll back."""

    enabled: bool = True  # off under 16-mixed precision, whose gradient scaler already skips such steps
    max_consecutive: int = 3


@dataclass
class SpikeGuardConfig:
    """Loss above ``mean + k * std`` of the last ``window`` normal steps for ``m`` steps in a row: roll back to
    the last good state, skip the data read since, scale the learning rate by ``lr_factor`` for ``lr_steps``."""

    enabled: bool = False
    k: float = 4.0
    m: int = 3
    window: int = 100
    min_history: int = 20  # normal steps seen before spikes are detected
    lr_factor: float = 1.0
    lr_steps: int = 0


@dataclass
class HangGuardConfig:
    """A step longer than ``max(min_seconds, factor * median of recent steps)`` dumps every rank's Python stacks
    to ``<run_dir>/hang-rank<r>.txt`` and exits with status 1; the first steps get ``startup_seconds``."""

    enabled: bool = True
    factor: float = 20.0
    min_seconds: float = 300.0
    startup_seconds: float = 1800.0
    collective_timeout_seconds: float = 3600.0  # DDP/FSDP process group: longer than the dump above


@dataclass
class GuardsConfig:
    """Unattended runs (``pretrain.training.callbacks.guards``). Rollbacks restore a host-memory copy of the weights and
    optimizer taken at train start, at every checkpoint and every ``snapshot_every`` steps (0: checkpoints only),
    always at a step with no anomaly running."""

    nonfinite: NonFiniteGuardConfig = field(default_factory=NonFiniteGuardConfig)
    spike: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
    hang: HangGuardConfig = field(default_factory=HangGuardConfig)
    snapshot_every: int = 0
    max_rollbacks: int = 10  # then the run stops with an error


@dataclass
class EvalDuringFitConfig:
    """In-context evaluation of the training model itself every ``every_n_steps`` optimizer steps
    (``pretrain.training.callbacks.in_loop_eval``; the task options of ``pretrain evaluate``); off while ``tasks`` is empty."""

    tasks: list[str] = field(default_factory=list)  # names in configs/eval/ or task YAML paths
    every_n_steps: int = 500
    limit: int | None = None  # first N examples (documents) per task
    num_fewshot: int | None = None  # overrides every task's num_fewshot
    batch_size: int = 16  # sequences per forward pass (per rank)
    data_root: str | None = field(default_factory=shared_data)  # fills ${data_root} in task files
    seed: int = 1234  # few-shot sampler seed (lm-eval's default)


@dataclass
class EMAConfig:
    """The weights' exponential moving average (``pretrain.training.callbacks.ema``): off while ``decay`` is null."""

    decay: float | None = None  # in (0, 1): ema <- decay * ema + (1 - decay) * weights
    every_n_steps: int = 1  # optimizer steps between updates
    start_step: int = 0  # the first update copies the weights


def ema_problems(e: EMAConfig) -> list[str]:
    problems = []
    if e.decay is not None and not 0.0 < e.decay < 1.0:
        problems.append(
            f"ema.decay must be in (0, 1) (e.g. 0.999: an average over ~1000 updates), got {e.decay}; "
            "or ema.decay=null to turn the EMA off"
        )
    if e.every_n_steps < 1:
        problems.append(f"ema.every_n_steps must be >= 1, got {e.every_n_steps}")
    if e.start_step < 0:
        problems.append(f"ema.start_step must be >= 0, got {e.start_step}")
    return problems


@dataclass
class InitConfig:
    """Starting weights of a fresh run (continued pretraining, context extension): ``checkpoint``, a `pretrain fit`
    checkpoint file or sharded directory. Weights only: step, optimizer, learning-rate schedule and data start
    anew. The model may differ from the checkpoint's where the weights do not (``rope_scaling``, ``rope_theta``,
    ``max_seq_len`` of a rotary model, the attention pattern, run-time fields); the tokenizer must be the same.
    A run that resumes ignores it (its own checkpoint holds the newer weights)."""

    checkpoint: str | None = None


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 1337
    run_dir: str | None = None  # default: runs/<name> (validate sets it; read it as run_path)
    resume: str | None = "auto"  # "auto": newest valid checkpoint in run_dir if any; a path; or None (fresh)
    # resume although these differ from the checkpoint's (the warning says what happens; docs/long-runs.md)
    resume_allow: list[ResumeChange] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    eval_during_fit: EvalDuringFitConfig = field(default_factory=EvalDuringFitConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    # a scaling-law ladder's sizes and budgets, read by `pretrain ladder` (pretrain.ladder.config checks it);
    # the other verbs train, tokenize and prepare the recipe as it is
    ladder: dict[str, Any] | None = None

    @property
    def run_path(self) -> Path:
        """``run_dir``, set once the config is validated."""
        assert self.run_dir is not None, "run_dir is set when the config is validated"
        return Path(self.run_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_path / "checkpoints"


class TrainingRun(Protocol):
    """What ``pretrain.training.trainer.build_trainer`` builds a Trainer from: a ``RunConfig``, or any run config
    holding the same sections (``pretrain.finetuning.config.FinetuneConfig``)."""

    name: str
    run_dir: str | None
    resume: str | None
    data: Any  # .micro_batch_size (DeepSpeed's config)
    trainer: TrainerConfig
    strategy: StrategyConfig
    logger: LoggerConfig
    checkpoint: CheckpointConfig
    guards: GuardsConfig

    @property
    def run_path(self) -> Path: ...

    @property
    def checkpoint_dir(self) -> Path: ...


def validate(raw: dict[str, Any]) -> RunConfig:
    """Typed ``RunConfig`` from a resolved dict, with cross-field checks. Every problem is reported at once (as
    litgpt's ``validate_args``): one ``ValueError`` listing them all, so one edit of the recipe fixes them."""
    run = structured(RunConfig, raw)
    problems: list[str] = []
    _collect(problems, check_run_name, run.name)
    if run.run_dir is None:
        run.run_dir = f"runs/{run.name}"
    t = run.trainer
    if t.precision in ("32", "16", "bf16"):
        t.precision = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}[t.precision]
    if t.precision not in PRECISIONS:
        problems.append(f"trainer.precision: {t.precision!r} is not one of {list(PRECISIONS)}")
    for name in (
        "max_steps",
        "devices",
        "num_nodes",
        "accumulate_grad_batches",
        "val_check_interval",
        "log_every_n_steps",
    ):
        if getattr(t, name) < 1:
            problems.append(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    if not t.progress_seconds > 0:
        problems.append(f"trainer.progress_seconds must be > 0, got {t.progress_seconds}")
    problems.extend(shared_problems(t, run.checkpoint))
    if run.data.micro_batch_size < 1 or run.data.seq_len < 1:
        problems.append("data.micro_batch_size and data.seq_len must be >= 1")
    if run.data.num_workers < 0:
        problems.append(f"data.num_workers must be >= 0, got {run.data.num_workers}")
    if not 0 <= run.data.val_fraction < 1:
        problems.append(f"data.val_fraction must be in [0, 1), got {run.data.val_fraction}")
    if not 0 <= run.seed < 2**32:
        problems.append(f"seed must be in [0, 2**32) (numpy's seeds), got {run.seed}")
    bad_weights = [
        i for i, s in enumerate(run.data.sources) if not (math.isfinite(s.weight) and s.weight > 0)
    ]
    if bad_weights:
        problems.append(
            f"data.sources[{bad_weights[0]}].weight must be a finite number > 0 (a blend weight), got "
            f"{run.data.sources[bad_weights[0]].weight}"
        )
    if run.data.seq_len > run.model.max_seq_len:
        problems.append(
            f"data.seq_len={run.data.seq_len} exceeds model.max_seq_len={run.model.max_seq_len}; "
            "lower data.seq_len or raise model.max_seq_len"
        )
    problems += _window_problems(run.model, run.data.seq_len)
    if not run.data.sources:
        problems.append("data.sources is empty; list at least one corpus")
    _collect(problems, _check_objective, run.objective)
    if t.float8:
        _collect(problems, _check_float8, run)
    for i, source in enumerate(run.data.sources):
        try:
            document_mode(source.document)
        except InputError as err:
            problems.append(f"data.sources[{i}].{err}")
    _collect(problems, _check_sources, run.data.sources)
    _collect(problems, _check_schedule, run.data, run.trainer.max_steps)
    problems += optim_problems(run.optim) + _guards_problems(run.guards)
    problems += muon_problems(run.optim, run.strategy.name, run.model.parametrization)
    problems += parallel_problems(run)
    _collect(problems, _check_eval_during_fit, run.eval_during_fit)
    if run.strategy.name == "deepspeed" and run.checkpoint.async_save:
        problems.append(ASYNC_DEEPSPEED)
    problems += ema_problems(run.ema)
    if run.strategy.name == "deepspeed" and run.guards.spike.enabled:
        problems.append(
            "guards.spike is not supported with strategy deepspeed (its engine owns the optimizer state); "
            "set guards.spike.enabled=false or use strategy ddp / fsdp"
        )
    if len(problems) > 1:
        raise InputError(f"{len(problems)} problems in the config: " + "; ".join(problems))
    if problems:
        raise InputError(problems[0])
    return run


def _window_problems(model: ModelConfig, seq_len: int) -> list[str]:
    """A window that spans every sample (w >= data.seq_len: every |q - k| < w) restricts nothing: the layers it
    is meant to keep local would attend globally."""
    return [
        f"model.{name}={w} is not smaller than data.seq_len={seq_len}: every pair of positions is within the window, "
        f"so those layers attend globally; lower model.{name} below {seq_len} or set it to 0 for global attention"
        + (" (and model.global_attn_every_n_layers=1)" if name == "local_attention_window" else "")
        for name, w in (
            ("attention_window", model.attention_window),
            ("local_attention_window", model.local_attention_window),
        )
        if w >= seq_len
    ]


def _collect(problems: list[str], check: Any, *args: Any) -> None:
    """Run ``check(*args)``; the message of each ``InputError`` it raises goes to ``problems``."""
    try:
        check(*args)
    except InputError as err:
        problems.append(str(err))


def _check_sources(sources: list[SourceConfig]) -> None:
    """Each source has its own name and its own ``prepared`` directory (one would overwrite the other)."""
    names: dict[str, int] = {}
    dirs: dict[Path, int] = {}
    for i, source in enumerate(sources):
        if source.name in names:
            raise InputError(
                f"data.sources[{i}].name={source.name!r} is also data.sources[{names[source.name]}]'s; "
                "give every source its own name"
            )
        names[source.name] = i
        where = Path(source.prepared).expanduser().resolve()
        if where in dirs:
            raise InputError(
                f"data.sources[{i}].prepared={source.prepared!r} is also data.sources[{dirs[where]}]'s prepared "
                "directory: the second `prepare` would overwrite the first; give each source its own directory"
            )
        dirs[where] = i


def _check_schedule(data: DataConfig, max_steps: int) -> None:
    """Phases in increasing step order from 0, each before ``trainer.max_steps``, weighing known sources by
    non-negative weights that sum to 1."""
    names = [s.name for s in data.sources]
    previous = None
    for i, phase in enumerate(data.schedule.phases):
        where = f"data.schedule.phases[{i}]"
        if i == 0 and phase.start != 0:
            raise InputError(f"{where}.start={phase.start}: the first phase must start at step 0")
        if previous is not None and phase.start <= previous:
            raise InputError(
                f"{where}.start={phase.start} is not after phases[{i - 1}].start={previous}: phases must be listed "
                "in increasing step order, each starting where the previous one ends (no overlap)"
            )
        if phase.start >= max_steps:
            raise InputError(
                f"{where}.start={phase.start} is past the run's end (trainer.max_steps={max_steps}); drop the "
                "phase or raise trainer.max_steps"
            )
        unknown = sorted(set(phase.weights) - set(names))
        if unknown:
            raise InputError(f"{where}.weights names unknown source(s) {unknown}; data.sources are {names}")
        bad = {k: v for k, v in phase.weights.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise InputError(f"{where}.weights must be >= 0, got {bad}")
        total = sum(phase.weights.values())
        if abs(total - 1) > 1e-6:
            raise InputError(f"{where}.weights sum to {total:g}, not 1: {dict(phase.weights)}")
        previous = phase.start


def mixture_schedule(data: DataConfig):
    """The ``pretrain.datamodules.schedule.MixtureSchedule`` of ``data.schedule`` (sources in ``data.sources`` order),
    or None when it has no phases."""
    if not data.schedule.phases:
        return None
    from pretrain.datamodules.schedule import MixtureSchedule

    names = [s.name for s in data.sources]
    return MixtureSchedule(
        [p.start for p in data.schedule.phases],
        [[p.weights.get(n, 0.0) for n in names] for p in data.schedule.phases],
        data.schedule.interpolation,
    )


def _check_objective(o: ObjectiveConfig) -> None:
    """The options are the objective's (``pretrain.objectives.check_options``), of their annotated types."""
    from pretrain.objectives.options import check_options, option_types

    if "document_masking" in o.options:
        raise InputError(
            "objective.options.document_masking was replaced by data.document_mask (document boundaries now come "
            "from the prepared corpus, for every objective); drop the option and set data.document_mask"
        )
    try:
        check_options(o.name, o.options)
    except InputError as err:
        raise InputError(
            f"objective.options: {err} (an option from another objective's piece: drop them with ~objective.options)"
        ) from None
    hints = option_types(o.name)
    for name, value in o.options.items():
        try:
            o.options[name] = check_type(value, hints.get(name, Any), f"objective.options.{name}")
        except TypeError:  # a type the schema checker does not model (a Mapping): the objective checks it
            continue


def check_optim(o: OptimConfig) -> None:
    """``ValueError`` listing every out-of-range ``optim`` field (pretraining and finetuning alike)."""
    if failing := optim_problems(o):
        raise InputError("; ".join(failing))


def _check_float8(run: RunConfig) -> None:
    """float8 training needs float8 tensor cores, bf16 autocast or weights, and a strategy torchao composes with."""
    import torch

    t = run.trainer
    on_gpu = t.accelerator in ("gpu", "cuda") or (t.accelerator == "auto" and torch.cuda.is_available())
    if not on_gpu:
        raise InputError(
            "trainer.float8=true needs CUDA GPUs with float8 tensor cores (H100/H200/B200/L4/L40S/RTX 4090, "
            "compute capability >= 8.9); this run is on the CPU, which has none: set trainer.float8=false"
        )
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise InputError(
            f"trainer.float8=true needs compute capability >= 8.9, {torch.cuda.get_device_name()} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}: set trainer.float8=false"
        )
    if not t.precision.startswith("bf16"):
        raise InputError(
            f"trainer.float8=true computes around bf16: set trainer.precision=bf16-mixed, not {t.precision}"
        )
    if run.strategy.name == "deepspeed":
        raise InputError("trainer.float8=true composes with strategy auto, ddp or fsdp, not deepspeed")


def optim_problems(o: OptimConfig) -> list[str]:
    checks = [
        (0 < o.lr < math.inf, f"optim.lr must be a finite number > 0, got {o.lr}"),
        (0 < o.eps < math.inf, f"optim.eps must be a finite number > 0, got {o.eps}"),
        (
            0 <= o.weight_decay < math.inf,
            f"optim.weight_decay must be a finite number >= 0, got {o.weight_decay}",
        ),
        (
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}",
        ),
        (o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}"),
        (0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}"),
        (
            0 < o.cooldown_fraction <= 1,
            f"optim.cooldown_fraction must be in (0, 1], got {o.cooldown_fraction}",
        ),
    ]
    return [message for ok, message in checks if not ok]


def muon_problems(o: OptimConfig, strategy: str, parametrization: str = "standard") -> list[str]:
    """``optim.muon`` out of range, or Muon where it cannot run (pretraining and finetuning alike)."""
    if o.name != "muon":
        return []
    import torch

    if not hasattr(torch.optim, "Muon"):
        return [f"optim.name=muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}"]
    m, problems = o.muon, []
    if not (m.lr > 0 and 0 <= m.momentum < 1 and 1 <= m.ns_steps < 100 and m.weight_decay >= 0):
        problems.append(
            f"optim.muon needs lr > 0, momentum in [0, 1), ns_steps in [1, 99], weight_decay >= 0; got lr={m.lr}, "
            f"momentum={m.momentum}, ns_steps={m.ns_steps}, weight_decay={m.weight_decay}"
        )
    if strategy == "deepspeed":
        problems.append(
            "optim.name=muon is not supported with strategy deepspeed (ZeRO flattens and partitions parameters; "
            "Newton-Schulz needs whole matrices); use strategy ddp or fsdp"
        )
    if parametrization == "mup" and m.adjust_lr != "original":
        problems.append(
            "optim.muon.adjust_lr=match_rms_adamw grows the update with width (0.2 sqrt(max(out, in))), which "
            "breaks muP transfer; use adjust_lr=original with model.parametrization=mup"
        )
    return problems


def _guards_problems(g: GuardsConfig) -> list[str]:
    checks = [
        ("nonfinite.max_consecutive", g.nonfinite.max_consecutive >= 1, ">= 1"),
        ("spike.k", g.spike.k > 0, "> 0"),
        ("spike.m", g.spike.m >= 1, ">= 1"),
        ("spike.window", g.spike.window >= 2, ">= 2"),
        ("spike.min_history", 2 <= g.spike.min_history <= g.spike.window, "in [2, guards.spike.window]"),
        ("spike.lr_factor", 0 < g.spike.lr_factor <= 1, "in (0, 1]"),
        ("spike.lr_steps", g.spike.lr_steps >= 0, ">= 0"),
        ("hang.factor", g.hang.factor > 1, "> 1"),
        ("hang.min_seconds", g.hang.min_seconds > 0, "> 0"),
        ("hang.startup_seconds", g.hang.startup_seconds > 0, "> 0"),
        (
            "hang.collective_timeout_seconds",
            g.hang.collective_timeout_seconds > max(g.hang.min_seconds, g.hang.startup_seconds),
            "> guards.hang.min_seconds and guards.hang.startup_seconds (the stack dump must come first)",
        ),
        ("snapshot_every", g.snapshot_every >= 0, ">= 0"),
        ("max_rollbacks", g.max_rollbacks >= 0, ">= 0"),
    ]
    return [f"guards.{name} must be {bound}" for name, ok, bound in checks if not ok]


def _check_eval_during_fit(e: EvalDuringFitConfig) -> None:
    """Bounds, and every task name resolves to a task file (its data is read when the Trainer is built)."""
    from pretrain.config.compose import resolve_task_file

    for name, value, low in (
        ("every_n_steps", e.every_n_steps, 1),
        ("batch_size", e.batch_size, 1),
        ("limit", e.limit, 1),
        ("num_fewshot", e.num_fewshot, 0),
    ):
        if value is not None and value < low:
            raise InputError(f"eval_during_fit.{name} must be >= {low}, got {value}")
    if twice := sorted({t for t in e.tasks if e.tasks.count(t) > 1}):
        raise InputError(f"eval_during_fit.tasks lists {twice} twice; list each task once")
    for name in e.tasks:
        try:
            resolve_task_file(name)
        except FileNotFoundError as err:
            raise InputError(f"eval_during_fit.tasks: {err}") from None


def load(recipe: str | Path, overrides: list[str] | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """Compose, resolve and validate a recipe: ``(typed config, resolved plain dict)``."""
    raw = compose(recipe, overrides)
    run = validate(raw)
    return run, to_dict(run)


def to_dict(run: RunConfig) -> dict[str, Any]:
    """The fully resolved config as plain Python (saved in checkpoints and logged to W&B)."""
    return dataclasses.asdict(run)
