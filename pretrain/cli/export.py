"""``pretrain export CHECKPOINT OUT_DIR [--force] [--ema]``: a checkpoint as a Hugging Face model directory."""

from __future__ import annotations

import argparse

from pretrain.cli.common import existing_checkpoint


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("checkpoint", help="a .ckpt (or a sharded FSDP/DeepSpeed checkpoint directory)")
    e.add_argument(
        "out_dir", help="output directory (config.json, model.safetensors, tokenizer); new or empty"
    )
    e.add_argument("--force", action="store_true", help="export into a non-empty directory, overwriting")
    e.add_argument(
        "--ema", action="store_true", help="export the weights' moving average (ema.decay) instead"
    )


def main(args: argparse.Namespace) -> int:
    from pretrain.finetuning.export import export_checkpoint

    path = existing_checkpoint(args.checkpoint, "export CHECKPOINT")
    out = export_checkpoint(path, args.out_dir, force=args.force, ema=args.ema)
    print(f"exported {args.checkpoint} -> {out} (transformers from_pretrained format)")
    return 0
