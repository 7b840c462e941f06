"""The ``pretrain evaluate`` schema (``EvalConfig``) and how a target, a recipe, overrides and flags become one.

The target is a checkpoint (``.ckpt``, run directory, or transformers directory) or an evaluation recipe (YAML
with the keys of ``EvalConfig``, composed by ``pretrain.config.compose``; ``key=value`` overrides follow it).
Flags override both; the result is validated by ``pretrain.config.structured`` like every other verb's config.
Tasks are names of ``configs/eval/<name>.yaml`` or paths to task files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pretrain.config import apply_overrides, compose, structured
from pretrain.config.compose import SHARED_DATA_VARIABLE, TASK_DIR, resolve_task_file, shared_data
from pretrain.errors import InputError

from .prompts import DEFAULT_FEWSHOT_SEED
from .tasks import TaskConfig, load_documents, load_examples, load_task


@dataclass
class EvalConfig:
    checkpoint: str | None = None
    tokenizer: str | None = None  # default: the checkpoint's own
    tasks: list[str] = field(default_factory=list)  # names in configs/eval/ or task YAML paths
    data_root: str | None = field(default_factory=shared_data)  # fills ${data_root} in task files
    num_fewshot: int | None = None  # overrides every task's num_fewshot
    seed: int = DEFAULT_FEWSHOT_SEED  # few-shot sampler seed
    limit: int | None = None  # first N examples (documents) per task
    batch_size: int = 16
    padding_side: Literal["left", "right"] = "right"
    unpadded: bool = True  # score requests packed into rows without padding (same log-likelihoods)
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_length: int | None = None  # default: the model's max_seq_len
    prefix_token: str | None = (
        None  # token conditioning an empty context (default: BOS if declared, else EOS)
    )
    output: str | None = None  # results JSON path
    log_samples: bool = False  # keep per-example records in the JSON
    wandb_project: str | None = None
    wandb_run_id: str | None = None  # log into this run (e.g. the training run; project default "pretrain")


def load_config(target: str, overrides: list[str], flags: dict[str, Any]) -> EvalConfig:
    """Recipe (if ``target`` is a YAML file, else ``checkpoint=target``) < ``key=value`` overrides < flags,
    validated against ``EvalConfig`` (unknown keys get a did-you-mean)."""
    if target.endswith((".yaml", ".yml")):
        raw = compose(target, overrides)  # a path or a shipped recipe (recipes/eval-core.yaml)
    else:
        raw = apply_overrides({"checkpoint": target}, overrides)
    raw |= {k: v for k, v in flags.items() if v is not None}
    config = structured(EvalConfig, raw)
    if config.limit is not None and config.limit < 1:
        raise InputError(
            f"limit (--limit) must be >= 1 (the first N examples of each task), got {config.limit}; omit it "
            "for all"
        )
    if config.num_fewshot is not None and config.num_fewshot < 0:
        raise InputError(f"num_fewshot (--num-fewshot) must be >= 0, got {config.num_fewshot}")
    if config.batch_size < 1:
        raise InputError(f"batch_size (--batch-size) must be >= 1, got {config.batch_size}")
    if config.max_length is not None and config.max_length < 4:
        raise InputError(f"max_length must be >= 4 tokens (or null: the model's), got {config.max_length}")
    if not config.checkpoint:
        raise InputError("no checkpoint: give one (pretrain evaluate CHECKPOINT) or set checkpoint=PATH")
    if not config.tasks:
        known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
        raise InputError(f"no tasks: pass --tasks NAME[,NAME] (known: {known}) or list tasks in the recipe")
    if twice := sorted({t for t in config.tasks if config.tasks.count(t) > 1}):
        raise InputError(f"tasks {twice} are listed twice (--tasks / tasks); list each task once")
    for name in config.tasks:
        resolve_task_file(name)  # an unknown name in one line before anything heavy is imported
    return config


def load_tasks(
    config: EvalConfig, data_root_key: str = "--data-root (data_root in an evaluation recipe)"
) -> list[TaskConfig]:
    """Task configs (``num_fewshot`` overriding every task but perplexity ones) with their data validated
    (file:line errors) before any model is loaded. A task whose files are not found under ``config.data_root``
    names ``data_root_key``, the setting that gave it."""
    try:
        return _load_tasks(config)
    except (FileNotFoundError, InputError) as err:
        if "data_root" not in str(err):  # not a task's data (an unknown task name, a malformed task file)
            raise
        where = f"data_root={config.data_root}" if config.data_root else "no data_root"
        raise InputError(
            f"{err} ({where}: set {data_root_key} to the directory holding the task data, or "
            f"{SHARED_DATA_VARIABLE})"
        ) from err


def _load_tasks(config: EvalConfig) -> list[TaskConfig]:
    tasks = [load_task(resolve_task_file(name), config.data_root) for name in config.tasks]
    if config.num_fewshot is not None:  # perplexity tasks take no shots
        tasks = [t if t.type == "perplexity" else replace(t, num_fewshot=config.num_fewshot) for t in tasks]
    for task in tasks:
        if task.type == "perplexity":
            load_documents(task.path, task.document, 1)
        else:
            load_examples(task.path, task.type)
            if task.fewshot_path:
                load_examples(task.fewshot_path, task.type)
    return tasks
