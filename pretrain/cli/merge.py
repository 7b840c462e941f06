"""``pretrain merge CHECKPOINT ... --out FILE [--weights W,...]``: a weighted average of checkpoints' weights."""

from __future__ import annotations

import argparse


def add_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("checkpoints", nargs="+", help="checkpoints of one model (files or sharded directories)")
    m.add_argument("--out", required=True, help="the merged checkpoint file (weights only)")
    m.add_argument("--weights", help="comma-separated, one per checkpoint, summing to 1 (default: uniform)")


def main(args: argparse.Namespace) -> int:
    """The weighted average of checkpoints' weights (``checkpoint.merge``) as one checkpoint file."""
    from pretrain.checkpoint.merge import merge, parse_weights

    weights = parse_weights(args.weights) if args.weights is not None else None
    out = merge(args.checkpoints, args.out, weights)
    print(f"merged {len(args.checkpoints)} checkpoints -> {out}")
    return 0
