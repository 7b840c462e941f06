"""``pretrain plan RECIPE [key=value ...] --gpus N --gpu-memory 80GiB [--tp T] [--cp C]``: per-GPU memory of a
recipe under each strategy (and FSDP2 x TP x CP), and the largest micro-batch that fits
(``pretrain.training.plan``)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from pretrain import config
from pretrain.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt2-124m.yaml")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. data.micro_batch_size=16")
    p.add_argument("--gpus", type=int, default=8, help="ranks in all (default 8): dp x cp x tp")
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks: adds a row of FSDP2 x TP (default: the recipe's "
                        "strategy.tensor_parallel)")  # fmt: skip
    p.add_argument("--cp", type=int, default=None,
                   help="context-parallel ranks: adds a row of FSDP2 x CP (default: the recipe's "
                        "strategy.context_parallel)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise InputError(f"--gpus must be >= 1, got {args.gpus}")
    from pretrain.training.plan import format_table, parse_bytes, plan, with_layout

    memory = parse_bytes(args.gpu_memory)
    run, _ = config.load(args.recipe, args.overrides)
    run = replace(run, trainer=replace(run.trainer, compile=False, float8=False))  # eager shapes
    tp = run.strategy.tensor_parallel if args.tp is None else args.tp
    cp = run.strategy.context_parallel if args.cp is None else args.cp
    run = with_layout(run, args.gpus, tp, cp)
    print(format_table(plan(run, args.gpus, memory), run, args.gpus, memory))
    return 0
