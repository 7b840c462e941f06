"""``pretrain plan RECIPE [key=value ...] --gpus N --gpu-memory 80GiB``: per-GPU memory of a recipe under each
strategy, and the largest micro-batch that fits (``pretrain.training.plan``)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from pretrain import config
from pretrain.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt2-124m.yaml")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. data.micro_batch_size=16")
    p.add_argument("--gpus", type=int, default=8, help="data-parallel ranks (default 8)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")


def main(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise InputError(f"--gpus must be >= 1, got {args.gpus}")
    from pretrain.training.plan import format_table, parse_bytes, plan

    memory = parse_bytes(args.gpu_memory)
    run, _ = config.load(args.recipe, args.overrides)
    run = replace(run, trainer=replace(run.trainer, compile=False, float8=False))  # eager shapes
    print(format_table(plan(run, args.gpus, memory), run, args.gpus, memory))
    return 0
