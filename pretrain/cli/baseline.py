"""``pretrain baseline RECIPE [key=value ...] [--print-config]``."""

from __future__ import annotations

import argparse

from pretrain.baselines.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="baseline recipe, e.g. recipes/sgns-tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. baselines.window=3")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def main(args: argparse.Namespace) -> int:
    """``pretrain baseline RECIPE [key=value ...]``."""
    resolved = load_config(args.recipe, args.overrides)[2]  # checked before torch and Lightning are imported
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(resolved), end="")
        return 0
    from pretrain.baselines.run import run_recipe  # torch and Lightning: after the recipe is checked

    results = run_recipe(args.recipe, args.overrides)
    print("\n== baseline: done ==")
    for key, value in results.items():
        if isinstance(value, dict):
            value = "; ".join(
                f"{k}: {', '.join(w for w, _ in v[:5]) if isinstance(v, list) else v}"
                for k, v in value.items()
            )
        print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    return 0
