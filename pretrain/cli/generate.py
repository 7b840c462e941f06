"""``pretrain generate CHECKPOINT [--prompt TEXT] ...``: sample text from a checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

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
    import torch

    from pretrain.checkpoint.convert import load_model
    from pretrain.models.generation import generate

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
    cfg = model.config
    from pretrain.datamodules.tokenizer import TextEncoder

    prompt = TextEncoder(tokenizer).encode(args.prompt)  # a prompt spelling "</s>" is that text, not EOS
    ids = torch.tensor([prompt] * args.num_samples, dtype=torch.long)
    if ids.shape[1] == 0 and cfg.arch == "decoder":
        raise InputError("the prompt is empty; pass --prompt TEXT")
    max_new_tokens = _max_new_tokens(cfg, ids.shape[1], args.max_new_tokens)
    eos = tokenizer.token_to_id(args.eos) if args.eos else None
    if args.eos and eos is None:
        raise InputError(
            f"--eos {args.eos!r} is not in the tokenizer's vocabulary; name one that is, or --eos ''"
        )
    generator = torch.Generator().manual_seed(args.seed)
    enc_dec = cfg.arch == "encoder-decoder"
    out = generate(
        model.eval(),
        None if enc_dec else ids,
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        eos_token_id=eos,
        generator=generator,
        encoder_input_ids=ids if enc_dec else None,
    )
    if enc_dec:
        print(span_filling_note(tokenizer, ids[0].tolist()))
    for i, row in enumerate(out.tolist()):
        text = tokenizer.decode(row if enc_dec else row[ids.shape[1] :], skip_special_tokens=not enc_dec)
        print(f"--- sample {i} ---\n{'' if enc_dec else args.prompt}{text}")
    return 0


DEFAULT_NEW_TOKENS = 100


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


def span_filling_note(tokenizer: Any, prompt_ids: list[int]) -> str:
    """What an encoder-decoder (span corruption) model's output is, and a warning for a prompt with no sentinel."""
    note = (
        "(a span-corruption model returns the spans its input's sentinels stand for, each after its sentinel: "
        "<extra_id_0> span <extra_id_1> span ...)"
    )
    if not any((tokenizer.id_to_token(i) or "").startswith("<extra_id_") for i in prompt_ids):
        note += (
            "\n(the prompt has no sentinel, so there is nothing to fill: mark missing text with <extra_id_0>, "
            'e.g. --prompt "To be, or <extra_id_0> to be")'
        )
    return note


def _max_new_tokens(cfg: Any, prompt_len: int, requested: int | None) -> int:
    """``--max-new-tokens`` (default: 100, or what the position table leaves). A model with a position table
    (learned / sinusoidal) cannot go past ``max_seq_len``: say so before generating instead of failing after."""
    if cfg.position not in ("learned", "sinusoidal"):
        return requested or DEFAULT_NEW_TOKENS
    limit = cfg.max_seq_len
    room = limit - 1 if cfg.arch == "encoder-decoder" else limit - prompt_len
    max_new_tokens = requested or min(DEFAULT_NEW_TOKENS, max(room, 1))
    if cfg.arch == "encoder-decoder":
        if prompt_len > limit or max_new_tokens + 1 > limit:
            raise InputError(
                f"the prompt ({prompt_len} tokens) or --max-new-tokens {max_new_tokens} exceeds the model's "
                f"{limit} positions; shorten the prompt or use --max-new-tokens {limit - 1}"
            )
    elif prompt_len + max_new_tokens > limit:
        raise InputError(
            f"the prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's {limit} "
            f"positions (model.max_seq_len); use --max-new-tokens {max(limit - prompt_len, 0)} or a shorter prompt"
        )
    return max_new_tokens
