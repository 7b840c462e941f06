"""LSTM vs transformer language models on the same corpus, tokenizer, objective, optimizer, token budget and size.

Both models see exactly the same batches: the train stream (a byte-level BPE trained on the training text, prepared
by ``pretrain.datamodules.prepare``) cut into B contiguous streams, T + 1 tokens per step and stream, through the ``clm``
objective (``pretrain.baselines.lstm_lm.StreamDataModule``), trained by the same Lightning Trainer with AdamW, warmup +
cosine and gradient clipping. The transformer (GPT-2 layout, learned positions, tied embeddings) reads every
window alone; the LSTM (2 layers, tied embeddings, width from ``pretrain.models.rnn.matched_width`` so its parameter
count matches the transformer's) carries its state between consecutive windows (truncated BPTT).

Validation perplexity on the held-out stream, per BPE token: the transformer with a context of T (non-overlapping
windows, as trained); the LSTM both with its state carried through the whole stream (its natural use) and reset
every window (the transformer's context). Printed: the table and the ratios LSTM / transformer.

    python benchmarks/compare_lstm_transformer.py                 # WikiText-2: train test.txt, validate valid.txt
    python benchmarks/compare_lstm_transformer.py --quick         # the shipped Tiny Shakespeare, a few steps
Options: --data-dir (default $PRETRAIN_SHARED_DATA/lm/wikitext-2), --steps, --batch, --seq-len, --d-model,
--layers, --vocab, --lr, --threads, --out (working directory for the tokenizer and prepared data).

Recorded run (defaults, ``--threads 1``, one CPU core shared with other jobs; BPE of 2048 tokens, 800 steps x 8 x 128
= 819,200 training tokens, both models 1.07M parameters, lr 2e-3 for both, not tuned per model):

    model           params  train tokens  tokens/s   val ppl   val ppl (state reset)
    transformer  1,071,872       819,200      3339    117.47                       -
    lstm         1,071,840       819,200      5317    190.05                  194.13
    ratio lstm / transformer: params 1.000, val ppl 1.618 (state reset 1.653), tokens/s 1.592
    validation: 360,448 tokens
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from pretrain import objectives
from pretrain.baselines.data import split_tokens
from pretrain.baselines.lstm_lm import LanguageModelModule, StreamDataModule, stream_perplexity
from pretrain.config import OptimConfig
from pretrain.datamodules.prepare import prepare
from pretrain.datamodules.tokenizer import train_bpe
from pretrain.models.config import ModelConfig
from pretrain.models.rnn import RNNConfig, RNNLanguageModel, matched_width
from pretrain.models.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]


def corpus(
    train_text: Path, val_text: Path | None, out: Path, vocab: int
) -> tuple[object, np.ndarray, np.ndarray]:
    """Tokenizer trained on the training text; train and validation token streams (5% of the documents of the
    training text when no validation text is given)."""
    tokenizer = train_bpe([train_text], vocab, out / "tokenizer.json", min_frequency=2, show_progress=False)
    if val_text is None:
        prepare(train_text, tokenizer, out / "data", val_fraction=0.05, progress=False)
        return tokenizer, split_tokens([out / "data"], "train"), split_tokens([out / "data"], "val")
    prepare(train_text, tokenizer, out / "train", val_fraction=0.0, progress=False)
    prepare(val_text, tokenizer, out / "val", val_fraction=0.0, progress=False)
    return tokenizer, split_tokens([out / "train"], "train"), split_tokens([out / "val"], "train")


def models(
    vocab_size: int, d_model: int, layers: int, seq_len: int, dropout: float
) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    transformer = Transformer(
        ModelConfig(
            arch="decoder",
            vocab_size=vocab_size,
            d_model=d_model,
            n_layer=layers,
            n_head=max(1, d_model // 32),
            max_seq_len=seq_len,
            dropout=dropout,
            tie_embeddings=True,
        )
    )
    lstm_cfg = RNNConfig(cell="lstm", vocab_size=vocab_size, n_layer=2, dropout=dropout, tie_embeddings=True)
    width = matched_width(transformer.num_params(), lstm_cfg)
    lstm = RNNLanguageModel(RNNConfig(**{**lstm_cfg.__dict__, "d_embed": width, "d_hidden": width}))
    return {"transformer": transformer, "lstm": lstm}


def train(model: torch.nn.Module, data: StreamDataModule, objective, optim: OptimConfig, steps: int) -> float:
    """Train ``steps`` optimizer steps; returns the wall-clock seconds."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(LanguageModelModule(model, optim, steps, objective), datamodule=data)
    return time.perf_counter() - start


def compare(
    train_text: Path,
    val_text: Path | None,
    out: Path,
    *,
    vocab: int = 2048,
    d_model: int = 128,
    layers: int = 4,
    seq_len: int = 128,
    batch: int = 8,
    steps: int = 800,
    lr: float = 2e-3,
    dropout: float = 0.1,
) -> dict[str, dict[str, float]]:
    """Train both models on the same batches; their sizes, tokens and validation perplexities."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, train_tokens, val_tokens = corpus(train_text, val_text, out, vocab)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    objective = objectives.build("clm", tokenizer)
    optim = OptimConfig(lr=lr, weight_decay=0.01, warmup_steps=max(1, steps // 20), schedule="cosine")
    results = {}
    for name, model in models(vocab_size, d_model, layers, seq_len, dropout).items():
        data = StreamDataModule(train_tokens, None, objective, seq_len, batch)
        seconds = train(model, data, objective, optim, steps)
        val = stream_perplexity(model, objective, val_tokens, seq_len, batch)
        row = {
            "params": model.num_params(),
            "train_tokens": steps * batch * seq_len,
            "seconds": seconds,
            "tokens_per_s": steps * batch * seq_len / seconds,
            "val_loss": val["loss"],
            "val_ppl": val["perplexity"],
            "val_tokens": val["tokens"],
        }
        if name == "lstm":
            row["val_ppl_reset"] = stream_perplexity(
                model, objective, val_tokens, seq_len, batch, carry=False
            )["perplexity"]
        results[name] = row
    return results


def report(results: dict[str, dict[str, float]]) -> str:
    t, r = results["transformer"], results["lstm"]
    header = ("model", "params", "train tokens", "tokens/s", "val ppl", "val ppl (state reset)")
    widths = (12, 10, 14, 10, 10, 24)
    rows = [header] + [
        (
            name,
            f"{x['params']:,}",
            f"{x['train_tokens']:,}",
            f"{x['tokens_per_s']:.0f}",
            f"{x['val_ppl']:.2f}",
            f"{x['val_ppl_reset']:.2f}" if "val_ppl_reset" in x else "-",
        )
        for name, x in (("transformer", t), ("lstm", r))
    ]
    lines = [
        "".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.append(
        f"ratio lstm / transformer: params {r['params'] / t['params']:.3f}, val ppl {r['val_ppl'] / t['val_ppl']:.3f}"
        f" (state reset {r['val_ppl_reset'] / t['val_ppl']:.3f}), tokens/s {r['tokens_per_s'] / t['tokens_per_s']:.3f}"
    )
    return "\n".join([*lines, f"validation: {t['val_tokens']:,} tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))
    parser.add_argument("--data-dir", type=Path, default=shared / "lm" / "wikitext-2")
    parser.add_argument(
        "--quick", action="store_true", help="the shipped Tiny Shakespeare with tiny settings"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare_lstm_transformer")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        train_text, val_text, steps = (
            REPO / "recipes" / "data" / "tinyshakespeare.txt",
            None,
            args.steps or 60,
        )
        args.out = args.out / "quick"
    else:
        train_text, val_text, steps = (
            args.data_dir / "test.txt",
            args.data_dir / "valid.txt",
            args.steps or 800,
        )
        for path in (train_text, val_text):
            if not path.is_file():
                raise SystemExit(
                    f"{path} not found; pass --data-dir (WikiText-2 with test.txt and valid.txt) or --quick"
                )
    results = compare(
        train_text,
        val_text,
        args.out,
        vocab=args.vocab,
        d_model=args.d_model,
        layers=args.layers,
        seq_len=args.seq_len,
        batch=args.batch,
        steps=steps,
        lr=args.lr,
    )
    print(f"corpus: {train_text.name} -> {'held-out documents' if val_text is None else val_text.name}")
    print(report(results))


if __name__ == "__main__":
    main()
