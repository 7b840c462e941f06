"""``pretrain generate CHECKPOINT [--prompt TEXT] ...``: sample text from a checkpoint."""

from __future__ import annotations

import argparse

from pretrain.cli.common import existing_checkpoint
from pretrain.errors import InputError


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("checkpoint", help="a .ckpt written by `pretrain fit` (or a sharded checkpoint directory)")
    g.add_argument("--prompt", default="\n", help="prompt text (encoder input for encoder-decoder models)")
    g.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: 100, or what the position table leaves"
    )
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eos", default="</s>", help="stop token ('' to never stop early)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model first (see README)")


def main(args: argparse.Namespace) -> int:
    check_sampling_flags(args)
    existing_checkpoint(args.checkpoint, "generate CHECKPOINT")
    from pretrain.checkpoint.convert import load_model
    from pretrain.models.generation import sample_texts, span_filling_note

    model, _, tokenizer = load_model(args.checkpoint)
    if tokenizer is None:
        raise InputError(f"{args.checkpoint} holds no tokenizer; cannot encode a text prompt")
    if model.config.arch == "encoder" or not model.config.lm_head:
        raise InputError(
            f"{args.checkpoint} is an encoder (model.arch={model.config.arch}): generate needs arch 'decoder' or "
            "'encoder-decoder' with an LM head; score an encoder with `pretrain evaluate` instead"
        )
    if args.compile:
        model.compile(dynamic=True)  # the cache grows every step: one graph with a symbolic length
    texts = sample_texts(
        model,
        tokenizer,
        args.prompt,
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        eos=args.eos,
        seed=args.seed,
    )
    if model.config.arch == "encoder-decoder":
        print(span_filling_note(tokenizer, args.prompt))
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
    return 0


def check_sampling_flags(args: argparse.Namespace) -> None:
    """``pretrain generate``'s numeric flags, named as flags (the library checks them under its own names)."""
    checks = [
        ("--num-samples", args.num_samples, args.num_samples >= 1, ">= 1"),
        (
            "--max-new-tokens",
            args.max_new_tokens,
            args.max_new_tokens is None or args.max_new_tokens >= 1,
            ">= 1",
        ),
        ("--temperature", args.temperature, args.greedy or args.temperature > 0, "> 0 (or --greedy)"),
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1"),
        ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
    ]
    for flag, value, ok, bound in checks:
        if not ok:
            raise InputError(f"{flag} must be {bound}, got {value}")
