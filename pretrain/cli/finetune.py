"""``pretrain finetune <recipe> [key=value ...] [--print-config]``."""

from __future__ import annotations

import argparse
import dataclasses

from omegaconf import OmegaConf

from pretrain.finetuning.config import check_init_checkpoint, load_config


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("recipe", help="finetuning recipe YAML, e.g. recipes/finetune-sst2-minilm.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(dataclasses.asdict(cfg)), end="")
        return 0
    check_init_checkpoint(cfg.init)
    from pretrain.finetuning.run import run  # torch and Lightning: after the recipe is checked

    results = run(cfg)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # Lightning sets the rank on the function  # the other data-parallel ranks
        return 0
    print("\n== pretrain finetune: done ==")
    print(f"  steps: {results['steps']} in {results['train_seconds']} s")
    for name, value in sorted(results.get("val", {}).items()):
        print(f"  val/{name}: {value:.4f}")
    print(f"  results: {cfg.run_path / 'results.json'}")
    return 0
