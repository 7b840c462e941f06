"""``pretrain fit RECIPE [key=value ...] [--print-config]``: train a recipe (``resume=auto`` by default)."""

from __future__ import annotations

import argparse

from pretrain import config
from pretrain.cli.common import recipe_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def main(args: argparse.Namespace) -> int:
    run, resolved = config.load(args.recipe, args.overrides)
    if args.print_config:
        from omegaconf import OmegaConf

        from pretrain.training.run import optimizer_groups

        print(OmegaConf.to_yaml(resolved), end="")
        print("".join(f"# {line}\n" for line in optimizer_groups(run).splitlines()), end="")
        return 0
    from pretrain.training.run import fit

    return fit(run, resolved, args.recipe, args.overrides)
