"""``pretrain tokenizer RECIPE [key=value ...] [--force]``: train the recipe's byte-level BPE (or reuse it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrain import config
from pretrain.cli.common import recipe_arguments
from pretrain.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe_arguments(p)
    p.add_argument("--force", action="store_true", help="retrain even if the file exists")


def main(args: argparse.Namespace) -> int:
    from pretrain.datamodules.corpus import InvalidUTF8Error, MissingInput
    from pretrain.datamodules.tokenizer import train_bpe

    run, _ = config.load(args.recipe, args.overrides)
    t = run.tokenizer
    path = Path(t.path)
    if path.exists() and not args.force:
        from pretrain.datamodules.tokenizer import load_tokenizer

        try:
            existing = load_tokenizer(path)
        except InputError as err:
            raise InputError(f"{err}; it may be truncated -- rerun with --force to retrain it") from err
        size = existing.get_vocab_size(with_added_tokens=True)
        if size > t.vocab_size:  # not the tokenizer asked for (a corpus too small gives fewer, never more)
            raise InputError(
                f"tokenizer {path} exists with {size} tokens, more than tokenizer.vocab_size={t.vocab_size}: it "
                "is not the one the recipe asks for; set tokenizer.path to a new file, or --force to retrain it "
                "(data prepared with the old one then needs `pretrain prepare` again)"
            )
        print(f"tokenizer {path} exists ({size} tokens); reusing it (--force retrains)")
        return 0
    if not t.train_files:
        raise InputError(
            f"tokenizer {path} does not exist and tokenizer.train_files is empty; list training text"
        )
    try:
        tokenizer = train_bpe(
            list(t.train_files),
            t.vocab_size,
            path,
            min_frequency=t.min_frequency,
            on_invalid_utf8=t.on_invalid_utf8,
        )
    except InvalidUTF8Error as err:
        raise InputError(err.with_fix("tokenizer.on_invalid_utf8")) from None
    except MissingInput as err:
        raise MissingInput(f"tokenizer.train_files: {err}") from None
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens -> {path}")
    return 0
