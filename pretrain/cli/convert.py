"""``pretrain convert CHECKPOINT --to single|dcp|hf OUT``: a checkpoint of any layout, rewritten tensor by tensor."""

from __future__ import annotations

import argparse

from pretrain.cli.common import existing_checkpoint


def add_arguments(c: argparse.ArgumentParser) -> None:
    from pretrain.checkpoint.stream import TARGETS

    c.add_argument("checkpoint", help="a checkpoint file, FSDP/async (DCP) or DeepSpeed checkpoint directory")
    c.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="single: one .ckpt file; dcp: a sharded (DCP) directory; hf: a transformers model directory",
    )
    c.add_argument("out", help="the new file or directory (must not exist; hf: new or empty)")


def main(args: argparse.Namespace) -> int:
    """A checkpoint of any layout as one file, a DCP directory, or a Hugging Face model directory (``export``)."""
    if args.to == "hf":
        from pretrain.finetuning.export import export_checkpoint

        checkpoint = existing_checkpoint(args.checkpoint, "convert CHECKPOINT")
        out = export_checkpoint(checkpoint, args.out, verb="convert")
        print(f"exported {args.checkpoint} -> {out} (transformers from_pretrained format)")
        return 0
    from pretrain.checkpoint.stream import convert

    out = convert(args.checkpoint, args.to, args.out)
    print(f"converted {args.checkpoint} -> {out} ({args.to})")
    return 0
