"""The ``pretrain`` command: ``fit``, ``validate``, ``generate``, ``export``, ``tokenizer``, ``prepare``, and the
later stages ``finetune``, ``evaluate`` and ``baseline``.

    pretrain tokenizer recipes/gpt-tiny.yaml                  # train the recipe's BPE tokenizer (or reuse it)
    pretrain prepare recipes/gpt-tiny.yaml                    # raw text -> token shards
    pretrain fit recipes/gpt-tiny.yaml trainer.max_steps=100  # train (resume=auto by default)
    pretrain validate recipes/gpt-tiny.yaml                   # validation loss of the newest checkpoint
    pretrain generate runs/gpt-tiny/checkpoints/last.ckpt --prompt "ROMEO:" --top-k 50
    pretrain export runs/gpt-tiny/checkpoints/last.ckpt runs/gpt-tiny/hf
    pretrain plot runs/gpt-tiny runs/bert-tiny --out curves.png   # overlay runs' loss, lr, tokens/s
    pretrain plan recipes/gpt2-124m.yaml --gpus 8 --gpu-memory 80GiB   # memory per strategy, before a run
    pretrain finetune recipes/finetune-sst2-minilm.yaml
    pretrain evaluate runs/gpt-tiny/checkpoints/last.ckpt --tasks copa --num-fewshot 3 --data-root DIR
    pretrain baseline recipes/lstm-lm-tiny.yaml

Recipe commands take ``key=value`` overrides after the recipe (then those of ``$PRETRAIN_OVERRIDES``, if set).
Bad input exits with status 2 and one line naming the problem, before any heavy work (``pretrain.errors``; ``--debug`` or ``PRETRAIN_DEBUG=1``: the
traceback). This module only parses and dispatches: each subcommand is a
``(module, add_arguments, handler, help)`` entry of ``COMMANDS``, and only the chosen one's module is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

from pretrain.errors import debug_requested, run_verb

# name -> (module, function adding its arguments, handler returning the exit status, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "tokenizer": (
        "pretrain.training.cli",
        "add_tokenizer_arguments",
        "cmd_tokenizer",
        "train the recipe's byte-level BPE tokenizer (reuse it if present)",
    ),
    "prepare": (
        "pretrain.training.cli",
        "add_prepare_arguments",
        "cmd_prepare",
        "tokenize the recipe's raw text into train/val token shards",
    ),
    "fit": (
        "pretrain.training.cli",
        "add_fit_arguments",
        "cmd_fit",
        "train a recipe (resumes from the newest valid checkpoint with resume=auto)",
    ),
    "validate": (
        "pretrain.training.cli",
        "add_validate_arguments",
        "cmd_validate",
        "validation metrics of a checkpoint",
    ),
    "generate": (
        "pretrain.training.cli",
        "add_generate_arguments",
        "cmd_generate",
        "sample text from a checkpoint (greedy, temperature, top-k, top-p)",
    ),
    "export": (
        "pretrain.training.cli",
        "add_export_arguments",
        "cmd_export",
        "write a checkpoint as a Hugging Face model directory",
    ),
    "plot": (
        "pretrain.training.cli",
        "add_plot_arguments",
        "cmd_plot",
        "plot train/val loss, learning rate and tokens/s of one or more runs (overlaid) into a PNG",
    ),
    "plan": (
        "pretrain.training.plan",
        "add_arguments",
        "cmd_plan",
        "per-GPU memory of a recipe under DDP, FSDP2 and ZeRO-1/2/3 (+ offload), and the largest micro-batch",
    ),
    "finetune": (
        "pretrain.finetuning.cli",
        "add_arguments",
        "cmd_finetune",
        "finetune a pretrained or Hugging Face backbone on a downstream task (heads, T5 text-to-text)",
    ),
    "evaluate": (
        "pretrain.evaluation.cli",
        "add_arguments",
        "run",
        "few-shot in-context and perplexity evaluation of a checkpoint",
    ),
    "baseline": (
        "pretrain.baselines.cli",
        "add_arguments",
        "cmd_baseline",
        "train and evaluate a classic baseline recipe (SGNS, GloVe, LSTM LM, seq2seq with attention)",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only ``command``'s module is imported (and its arguments added)."""
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--debug", action="store_true", help="on an error, the full traceback (or PRETRAIN_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add_arguments, handler, text) in COMMANDS.items():
        stage_parser = sub.add_parser(name, help=text, description=text)
        if name == command:
            stage = importlib.import_module(module)
            getattr(stage, add_arguments)(stage_parser)
            stage_parser.set_defaults(handler=getattr(stage, handler))
    return parser


def main(argv: list[str] | None = None) -> int:
    debug, argv = debug_requested(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), None))
    args, extra = parser.parse_known_args(argv)  # key=value overrides may also follow --flags
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if hasattr(args, "overrides") and os.environ.get(
        "PRETRAIN_OVERRIDES"
    ):  # e.g. a short smoke run of a recipe
        args.overrides = [*args.overrides, *shlex.split(os.environ["PRETRAIN_OVERRIDES"])]
    return run_verb(args.command, args.handler, args, debug)


if __name__ == "__main__":
    sys.exit(main())
