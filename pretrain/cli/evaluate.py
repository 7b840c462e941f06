"""``pretrain evaluate``: in-context (few-shot) evaluation and perplexity of a checkpoint.

    pretrain evaluate runs/gpt-tiny/checkpoints/last.ckpt --tasks copa,piqa --num-fewshot 5 --data-root DIR
    pretrain evaluate recipes/eval-core.yaml checkpoint=runs/gpt-tiny limit=200
    pretrain evaluate runs/gpt2/hf --tasks lambada_openai,wikitext2 --output results.json --wandb-project p

Arguments only: the config is ``pretrain.evaluation.config`` and the run ``pretrain.evaluation.runner``. Results
print as a table and, with ``output``, are written as JSON; with ``wandb_project`` or ``wandb_run_id`` they are
logged to W&B.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrain.evaluation.config import load_config, load_tasks
from pretrain.evaluation.prompts import DEFAULT_FEWSHOT_SEED


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


def main(args: argparse.Namespace) -> int:
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
    config = load_config(args.target, args.overrides, flags)
    assert config.checkpoint is not None  # load_config requires one
    if not Path(config.checkpoint).exists():
        raise FileNotFoundError(f"checkpoint {config.checkpoint} does not exist")
    tasks = load_tasks(config)  # and their data, in one line each
    from pretrain.evaluation.runner import (
        run_evaluation,  # torch: after the config and the task data are checked
    )

    run_evaluation(config, tasks)
    return 0
