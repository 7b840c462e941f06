"""``pretrain validate RECIPE [key=value ...] [--ckpt PATH]``: validation metrics of a checkpoint."""

from __future__ import annotations

import argparse

from pretrain import config
from pretrain.cli.common import existing_checkpoint, recipe_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe_arguments(p)
    p.add_argument("--ckpt", help="checkpoint (default: the newest valid one of the run)")


def main(args: argparse.Namespace) -> int:
    if args.ckpt:
        existing_checkpoint(args.ckpt, "--ckpt")
    overrides = list(args.overrides) + ([f"resume={args.ckpt}"] if args.ckpt else [])
    run, resolved = config.load(args.recipe, overrides)
    from pretrain.training.run import validate

    return validate(run, resolved)
