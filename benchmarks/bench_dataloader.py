"""Data-loader throughput vs the tiny GPT's training consumption, measured in the same run.

The loader is ``PretrainDataModule`` over a synthetic prepared corpus (random ids, Megatron .bin/.idx) with the
causal-LM objective (``pretrain.objectives.build("clm")``) applied per sample in the collate; it is timed in tokens/s of
model input for ``num_workers`` 0 and 2. The peer is one training step (forward, backward, AdamW) of the tiny
GPT recipe's model (configs/model/gpt-tiny.yaml) on batches of the same shape. Target: loader >= 100x the
model, so data loading never stalls training. Usage::

    python benchmarks/bench_dataloader.py [--batches 400] [--seq-len 128] [--micro-batch-size 16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models

from pretrain import objectives
from pretrain.datamodules.indexed import IndexedWriter
from pretrain.datamodules.pretrain import PretrainDataModule
from pretrain.datamodules.special_tokens import all_special_tokens

REPO = Path(__file__).resolve().parents[1]


def synthetic_corpus(root: Path, num_tokens: int, vocab_size: int, seed: int = 0) -> Path:
    """A prepared dir of random documents (~1000 tokens each) with train and val splits."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", num_tokens), ("val", num_tokens // 20)):
        tokens = rng.integers(0, vocab_size, n, dtype=np.uint16)
        with IndexedWriter(root / split, np.uint16) as writer:  # documents of about 1000 tokens
            lengths = np.diff(np.linspace(0, n, max(1, n // 1000) + 1).astype(np.int64))
            writer.add_documents(tokens, lengths)
    return root


def loader_tokens_per_s(dm: PretrainDataModule, num_batches: int) -> float:
    """Model-input tokens per second delivered by the training dataloader (after one warm-up batch)."""
    loader = iter(dm.train_dataloader())
    next(loader)  # worker start-up is a one-off cost
    start, tokens = time.perf_counter(), 0
    for batch in itertools.islice(loader, num_batches):
        tokens += batch["input_ids"].numel()
        dm.advance()
    return tokens / (time.perf_counter() - start)


def model_tokens_per_s(batch: dict[str, torch.Tensor], vocab_size: int, steps: int) -> float | None:
    """Training tokens/s of the tiny GPT (None when pretrain.models.transformer is not available)."""
    try:
        from pretrain.models.config import ModelConfig
        from pretrain.models.transformer import Transformer
    except ImportError:
        return None
    config = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "gpt-tiny.yaml"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**config, "vocab_size": vocab_size}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch["input_ids"].numel() / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--model-steps", type=int, default=10)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    vocab_size = 1024  # the tiny recipe's vocabulary
    specials = all_special_tokens()
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    objective = objectives.build("clm", Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    per_epoch = (args.batches + 1) * args.micro_batch_size * (args.seq_len + 1)
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_corpus(Path(tmp), 2 * per_epoch, vocab_size)
        results = {}
        for workers in args.workers:
            dm = PretrainDataModule(
                data,
                objective,
                seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size,
                num_workers=workers,
            )
            results[workers] = loader_tokens_per_s(dm, args.batches)
        batch = next(iter(dm.train_dataloader()))
    model = model_tokens_per_s(batch, vocab_size, args.model_steps)

    print(f"batch {args.micro_batch_size} x seq_len {args.seq_len}, clm objective, {args.batches} batches")
    for workers, rate in results.items():
        line = f"loader num_workers={workers}: {rate:,.0f} tokens/s"
        if model is not None:
            line += f"  = {rate / model:,.0f}x the tiny GPT's training step"
        print(line)
    if model is None:
        print("pretrain.models.transformer not available: loader speed only")
    else:
        print(f"tiny GPT training step: {model:,.0f} tokens/s (target: loader >= 100x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
