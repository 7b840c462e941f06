"""``pretrain evaluate``: in-context (few-shot) evaluation and perplexity of a checkpoint.

    pretrain evaluate runs/gpt-tiny/checkpoints/last.ckpt --tasks copa,piqa --num-fewshot 5 --data-root DIR
    pretrain evaluate recipes/eval-core.yaml checkpoint=runs/gpt-tiny limit=200
    pretrain evaluate runs/gpt2/hf --tasks lambada_openai,wikitext2 --output results.json --wandb-project p

The target is a checkpoint (``.ckpt``, run directory, or transformers directory) or an evaluation recipe
(YAML with the keys of ``EvalConfig``; ``key=value`` overrides follow it). Flags override both. Tasks are
names of ``configs/eval/<name>.yaml`` or paths to task files. Results print as a table and, with
``output``, are written as JSON; with ``wandb_project`` or ``wandb_run_id`` they are logged to W&B.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.config import CONFIG_DIR

from .prompts import DEFAULT_FEWSHOT_SEED
from .tasks import TaskConfig, load_documents, load_examples, load_task

TASK_DIR = CONFIG_DIR / "eval"


@dataclass
class EvalConfig:
    checkpoint: str | None = None
    tokenizer: str | None = None  # default: the checkpoint's own
    tasks: list[str] = field(default_factory=list)  # names in configs/eval/ or task YAML paths
    data_root: str | None = None  # fills ${data_root} in task files
    num_fewshot: int | None = None  # overrides every task's num_fewshot
    seed: int = DEFAULT_FEWSHOT_SEED  # few-shot sampler seed
    limit: int | None = None  # first N examples (documents) per task
    batch_size: int = 16
    padding_side: str = "right"
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "float32"
    max_length: int | None = None  # default: the model's max_seq_len
    prefix_token: str | None = (
        None  # token conditioning an empty context (default: BOS if declared, else EOS)
    )
    output: str | None = None  # results JSON path
    log_samples: bool = False  # keep per-example records in the JSON
    wandb_project: str | None = None
    wandb_run_id: str | None = None  # log into this run (e.g. the training run; project default "pretrain")


def resolve_task_file(name: str) -> Path:
    """A task file path, or ``configs/eval/<name>.yaml``; the error lists the known names."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = TASK_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"unknown task {name!r}: not a task file, and not one of {known} (configs/eval/)")


def load_config(target: str, overrides: list[str], flags: dict[str, Any]) -> EvalConfig:
    """Merge EvalConfig defaults < recipe (if ``target`` is a YAML file) < ``key=value`` overrides < flags."""
    layers = [OmegaConf.structured(EvalConfig)]
    if target.endswith((".yaml", ".yml")):
        if not Path(target).is_file():
            raise FileNotFoundError(f"evaluation recipe {target} not found")
        layers.append(OmegaConf.load(target))
    else:
        layers.append(OmegaConf.create({"checkpoint": target}))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. limit=100)")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        layers.append(OmegaConf.create({k: v for k, v in flags.items() if v is not None}))
        cfg = OmegaConf.merge(*layers)
        config = EvalConfig(**OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as err:
        raise ValueError(f"bad evaluation config: {err}".replace("\n", "; ")) from None
    if not config.checkpoint:
        raise ValueError("no checkpoint: give one (pretrain evaluate CHECKPOINT) or set checkpoint=PATH")
    if not config.tasks:
        known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
        raise ValueError(f"no tasks: pass --tasks NAME[,NAME] (known: {known}) or list tasks in the recipe")
    if config.padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {config.padding_side!r}")
    return config


def load_tasks(config: EvalConfig) -> list[TaskConfig]:
    """Task configs with their data validated (file:line errors) before any model is loaded."""
    overrides = {} if config.num_fewshot is None else {"num_fewshot": config.num_fewshot}
    tasks = [load_task(resolve_task_file(name), config.data_root, overrides) for name in config.tasks]
    for task in tasks:
        if task.type == "perplexity":
            load_documents(task.path, task.document_separator, 1)
        else:
            load_examples(task.path, task.type)
            if task.fewshot_path:
                load_examples(task.fewshot_path, task.type)
    return tasks


def run_evaluation(config: EvalConfig) -> dict[str, Any]:
    import torch

    from .models import load_scorer
    from .runner import evaluate, format_table, log_to_wandb, save_results

    tasks = load_tasks(config)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    scorer = load_scorer(
        config.checkpoint,
        config.tokenizer,
        device=device,
        dtype=config.dtype,
        prefix_token=config.prefix_token,
        max_length=config.max_length,
        batch_size=config.batch_size,
        padding_side=config.padding_side,
    )
    results = evaluate(scorer, tasks, seed=config.seed, limit=config.limit, log_samples=config.log_samples)
    results["config"] = {**asdict(config), "device": device, "max_length": scorer.max_length}
    print(format_table(results))
    if config.output:
        print(f"results -> {save_results(results, config.output)}")
    if config.wandb_project or config.wandb_run_id:
        import wandb

        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run = wandb.init(
            project=config.wandb_project or "pretrain",
            id=config.wandb_run_id,
            resume="allow",
            mode=mode,
            job_type="eval",
        )
        log_to_wandb(results, run)
        run.finish()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", help="checkpoint (.ckpt, run dir, transformers dir) or evaluation recipe YAML"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of EvalConfig, e.g. limit=100")
    parser.add_argument("--tasks", help="comma-separated task names (configs/eval/) or task YAML paths")
    parser.add_argument("--num-fewshot", type=int, help="shots for every task (default: each task's own)")
    parser.add_argument("--seed", type=int, help=f"few-shot sampler seed (default {DEFAULT_FEWSHOT_SEED})")
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples of each task")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--data-root", help="directory filling ${data_root} in task files")
    parser.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: auto)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output", help="write results JSON here")
    parser.add_argument(
        "--log-samples", action="store_true", default=None, help="per-example records in the JSON"
    )
    parser.add_argument("--wandb-project", help="log results to this W&B project")
    parser.add_argument("--wandb-run-id", help="log results into this existing W&B run")


def run(args: argparse.Namespace) -> int:
    """Entry point for ``pretrain evaluate`` (``args`` from a parser set up by ``add_arguments``)."""
    flags = {
        "tasks": args.tasks.split(",") if args.tasks else None,
        "num_fewshot": args.num_fewshot,
        "seed": args.seed,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "data_root": args.data_root,
        "tokenizer": args.tokenizer,
        "device": args.device,
        "dtype": args.dtype,
        "output": args.output,
        "log_samples": args.log_samples,
        "wandb_project": args.wandb_project,
        "wandb_run_id": args.wandb_run_id,
    }
    run_evaluation(load_config(args.target, args.overrides, flags))
    return 0


def add_evaluate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``evaluate`` on argparse ``subparsers``; the parser's ``func`` default is ``run``."""
    parser = subparsers.add_parser(
        "evaluate",
        help="few-shot and perplexity evaluation of a checkpoint",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser
