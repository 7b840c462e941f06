"""Data every baseline shares with pretraining: the recipe's tokenizer and prepared corpora (trained / written
first when missing, as ``pretrain tokenizer`` and ``pretrain prepare`` do) and their token streams."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pretrain.config import RunConfig, SourceConfig
from pretrain.errors import InputError


def ensure_tokenizer(run: RunConfig) -> Tokenizer:
    """The recipe's tokenizer, trained first (byte-level BPE) when missing and ``tokenizer.train_files`` is set."""
    from pretrain.datamodules.tokenizer import load_tokenizer, train_bpe

    path = Path(run.tokenizer.path)
    if not path.exists() and run.tokenizer.train_files:
        train_bpe(
            list(run.tokenizer.train_files),
            run.tokenizer.vocab_size,
            path,
            min_frequency=run.tokenizer.min_frequency,
            show_progress=False,
        )
    return load_tokenizer(path)


def ensure_prepared(source: SourceConfig, tokenizer: Tokenizer, val_fraction: float) -> Path:
    """``source.prepared`` (re)written from ``source.text`` unless up to date (``pretrain.datamodules.prepare`` cache)."""
    from pretrain.datamodules.prepare import prepare

    if source.text:
        prepare(
            list(source.text),
            tokenizer,
            source.prepared,
            val_fraction=val_fraction,
            document=source.document,
            text_field=source.text_field,
            progress=False,
        )
    elif not (Path(source.prepared) / "meta.json").is_file():
        raise FileNotFoundError(
            f"data source {source.name!r}: {source.prepared} is not a prepared corpus and no raw text is listed "
            "(data.sources[].text)"
        )
    return Path(source.prepared)


def prepared_dirs(run: RunConfig, tokenizer: Tokenizer) -> list[Path]:
    """The prepared directory of every ``data.sources`` entry, written first when missing or stale."""
    return [ensure_prepared(s, tokenizer, run.data.val_fraction) for s in run.data.sources]


def split_tokens(directories: Sequence[Path], split: str) -> np.ndarray:
    """The token streams of ``split`` of prepared directories (a directory prepared in tasks: its shards in
    order, as the datamodule reads it), one after the other (1-D int64)."""
    from pretrain.datamodules.prepare import shard_tokens

    parts = [np.asarray(t, dtype=np.int64) for d in directories for t in shard_tokens(d, split)]
    tokens = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if tokens.size == 0:
        raise InputError(f"the {split} split of {[str(d) for d in directories]} is empty")
    return tokens
