"""``pretrain plot RUN_DIR ... [--out PNG]``: runs' loss, learning rate and tokens/s curves, overlaid."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="run directories (holding logs/version_*/metrics.csv)")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")


def main(args: argparse.Namespace) -> int:
    from pretrain.training.callbacks.plots import plot_runs

    print(f"curves of {len(args.run_dirs)} run(s) -> {plot_runs(args.run_dirs, args.out)}")
    return 0
