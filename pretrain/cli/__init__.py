"""The ``pretrain`` command: ``fit``, ``validate``, ``generate``, ``export``, ``tokenizer``, ``prepare``, and the
later stages ``finetune``, ``evaluate`` and ``baseline``.

    pretrain tokenizer recipes/gpt-tiny.yaml                  # train the recipe's BPE tokenizer (or reuse it)
    pretrain prepare recipes/gpt-tiny.yaml                    # raw text -> token shards
    pretrain fit recipes/gpt-tiny.yaml trainer.max_steps=100  # train (resume=auto by default)
    pretrain validate recipes/gpt-tiny.yaml                   # validation loss of the newest checkpoint
    pretrain generate runs/gpt-tiny/checkpoints/last.ckpt --prompt "ROMEO:" --top-k 50
    pretrain export runs/gpt-tiny/checkpoints/last.ckpt runs/gpt-tiny/hf
    pretrain convert runs/gpt-fsdp/checkpoints/last.ckpt --to single one.ckpt   # any layout, tensor by tensor
    pretrain merge runs/a/checkpoints/step200.ckpt runs/a/checkpoints/step240.ckpt --out merged.ckpt
    pretrain plot runs/gpt-tiny runs/bert-tiny --out curves.png   # overlay runs' loss, lr, tokens/s
    pretrain plan recipes/gpt2-124m.yaml --gpus 8 --gpu-memory 80GiB   # memory per strategy, before a run
    pretrain finetune recipes/finetune-sst2-minilm.yaml
    pretrain evaluate runs/gpt-tiny/checkpoints/last.ckpt --tasks copa --num-fewshot 3 --data-root DIR
    pretrain baseline recipes/lstm-lm-tiny.yaml

Recipe commands take ``key=value`` overrides after the recipe (then those of ``$PRETRAIN_OVERRIDES``, if set).
Bad input exits with status 2 and one line naming the problem, before any heavy work (``pretrain.errors``; ``--debug`` or ``PRETRAIN_DEBUG=1``: the
traceback). This package's ``__init__`` only parses and dispatches: each subcommand is a
module ``pretrain.cli.<verb>`` (``add_arguments(parser)``, ``main(args) -> exit status``: arguments -> library
calls), named with its help in ``COMMANDS``, and only the chosen one's module is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from pretrain.errors import debug_requested, run_verb
from pretrain.training.quiet import quiet_libraries

OVERRIDES_VARIABLE = (
    "PRETRAIN_OVERRIDES"  # pretrain.config.compose's (not imported here: omegaconf is not needed
)
# by every verb)

# name -> help; the verb is the module pretrain.cli.<name>: add_arguments(parser), main(args) -> exit status
COMMANDS: dict[str, str] = {
    "tokenizer": "train the recipe's byte-level BPE tokenizer (reuse it if present)",
    "prepare": "tokenize the recipe's raw text into train/val token shards",
    "fit": "train a recipe (resumes from the newest valid checkpoint with resume=auto)",
    "validate": "validation metrics of a checkpoint",
    "generate": "sample text from a checkpoint (greedy, temperature, top-k, top-p)",
    "export": "write a checkpoint as a Hugging Face model directory",
    "convert": "rewrite a checkpoint of any layout as one file, a DCP directory or a transformers directory",
    "merge": "weighted average of the weights of checkpoints of one model, as one checkpoint file",
    "plot": "plot train/val loss, learning rate and tokens/s of one or more runs (overlaid) into a PNG",
    "plan": "per-GPU memory of a recipe under DDP, FSDP2 and ZeRO-1/2/3 (+ offload), and the largest micro-batch",
    "ladder": "scaling-law ladder: train sizes x budgets, fit L(N, D), predict a held-out cell, compute-optimal N and D",
    "finetune": "finetune a pretrained or Hugging Face backbone on a downstream task (heads, T5 text-to-text)",
    "evaluate": "few-shot in-context and perplexity evaluation of a checkpoint",
    "baseline": "train and evaluate a classic baseline recipe (SGNS, GloVe, LSTM LM, seq2seq with attention)",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only ``command``'s module is imported (and its arguments added)."""
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--debug", action="store_true", help="on an error, the full traceback (or PRETRAIN_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        stage_parser = sub.add_parser(name, help=text, description=text)
        if name == command:
            stage = importlib.import_module(f"pretrain.cli.{name}")
            stage.add_arguments(stage_parser)
            # run_verb: how a verb that runs others (ladder: tokenizer, prepare) reaches them, layers kept
            stage_parser.set_defaults(handler=stage.main, run_verb=main)
    return parser


def main(argv: list[str] | None = None) -> int:
    debug, argv = debug_requested(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), None))
    args, extra = parser.parse_known_args(argv)  # key=value overrides may also follow --flags
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        hint = ""
        if hasattr(args, "overrides") and any(e.startswith("--") for e in unknown):  # `--max-steps 3`
            hint = (
                "; a recipe's settings are key=value overrides, e.g. trainer.max_steps=100 (--print-config "
                "shows every key)"
            )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    handler = args.handler
    if hasattr(args, "overrides"):  # and $PRETRAIN_OVERRIDES's, e.g. a short smoke run of a recipe
        handler = partial(with_environment_overrides, handler)
    set_here = debug and "PRETRAIN_DEBUG" not in os.environ
    if set_here:  # the library notices too, in every process this one starts (data-parallel ranks)
        os.environ["PRETRAIN_DEBUG"] = "1"
    quiet_libraries()  # before the verb imports its libraries: every verb, as fit always did
    try:
        return run_verb(args.command, handler, args, debug)
    finally:
        if set_here:
            del os.environ["PRETRAIN_DEBUG"]


def with_environment_overrides(handler: Callable[[Any], int], args: argparse.Namespace) -> int:
    """``handler(args)`` with the overrides of ``$PRETRAIN_OVERRIDES`` after the command line's; bad input they
    set is said to come from there."""
    from pretrain.config.compose import blame_environment, environment_overrides
    from pretrain.errors import InputError

    from_environment = environment_overrides()
    for given in args.overrides:  # the variable wins, as its purpose is; a setting replaced is said so
        key = given.lstrip("~").partition("=")[0]
        for item in from_environment:
            other = item.lstrip("~").partition("=")[0]
            if key and (key == other or key.startswith(other + ".") or other.startswith(key + ".")):
                print(
                    f"pretrain {args.command}: {OVERRIDES_VARIABLE} sets {item} over the command line's {given}",
                    file=sys.stderr,
                )
    args.overrides = [*args.overrides, *from_environment]
    try:
        return handler(args)
    except InputError as err:
        blamed = blame_environment(err, from_environment)
        if blamed is err:
            raise
        raise blamed from err


if __name__ == "__main__":
    sys.exit(main())
