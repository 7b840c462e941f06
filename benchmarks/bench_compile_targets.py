"""A varying number of targets under ``torch.compile`` (inductor, CPU): a symbolic ``target_positions`` length
(``compile_compat.mark_dynamic``, what ``PretrainData`` does) against padding it up to a multiple of
``--bucket`` (static graphs, one per bucket; padded slots gather position 0 with label -100).

A tiny BERT MLM step (forward, the LM head on the N target positions, cross-entropy, backward) on batches whose
N is Binomial(B T, 0.15). Reported: graphs compiled, recompiles (``CompileCounts``; the two variants share the
backbone's code object, so the second variant's first graph counts as one), the in-process compile-phase CPU time
(the first steps, until every variant has seen each of its shapes) and the steady median step CPU ms, the two
variants' steps interleaved A/B/A/B so machine load hits both alike.

    python benchmarks/bench_compile_targets.py [--steps 40] [--bucket 64] [--d-model 128] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
from pretrain.compat.compile import CompileCounts, mark_dynamic
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


def batches(n: int, b: int, t: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, t), generator=g)
        labels = torch.where(torch.rand(b, t, generator=g) < 0.15, ids, -100)
        out.append((ids, labels))
    return out


def positions(labels: torch.Tensor, bucket: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    flat = labels.flatten()
    pos = (flat != -100).nonzero().squeeze(1)
    if bucket is None:
        return mark_dynamic(pos, 0), flat[pos]
    size = -(-len(pos) // bucket) * bucket
    padded = torch.zeros(size, dtype=torch.long)
    padded[: len(pos)] = pos
    target = torch.full((size,), -100, dtype=torch.long)
    target[: len(pos)] = flat[pos]
    return padded, target


def step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, bucket: int | None) -> float:
    start = time.process_time()
    pos, target = positions(labels, bucket)
    logits = model(input_ids=ids, target_positions=pos).logits
    F.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum").backward()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    cfg = ModelConfig(arch="encoder", vocab_size=args.vocab, d_model=args.d_model, n_layer=2, n_head=4,
                      max_seq_len=args.seq_len, norm_position="post", mlm_head_transform=True)  # fmt: skip
    variants = {"dynamic": None, f"bucket{args.bucket}": args.bucket}
    models = {}
    for name in variants:
        torch.manual_seed(0)
        models[name] = Transformer(cfg)
        models[name].check_inputs = False
        models[name].compile()
    data = batches(args.warmup + args.steps, args.batch, args.seq_len, args.vocab)
    counts = CompileCounts()
    times: dict[str, list[float]] = {name: [] for name in variants}
    compile_s = dict.fromkeys(variants, 0.0)
    for i, (ids, labels) in enumerate(data):
        for name, bucket in variants.items() if i % 2 else reversed(variants.items()):
            before = counts.graphs
            seconds = step(models[name], ids, labels, bucket)
            if i < args.warmup or counts.graphs > before:  # a step that compiled is compile time
                compile_s[name] += seconds
            else:
                times[name].append(seconds)
    sizes = sorted({-(-int((lab != -100).sum()) // args.bucket) * args.bucket for _, lab in data})
    print(f"MLM step, B={args.batch} T={args.seq_len} d={args.d_model} V={args.vocab}, {args.steps} steps after "
          f"{args.warmup}; N in [{min(int((lab != -100).sum()) for _, lab in data)}, "
          f"{max(int((lab != -100).sum()) for _, lab in data)}]; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        f"graphs compiled {counts.graphs} (both variants), recompiles {counts.recompiles}; buckets used {sizes}"
    )
    base = statistics.median(times["dynamic"])
    for name in variants:
        median = statistics.median(times[name])
        print(f"  {name:<10} steady {1000 * median:7.1f} ms/step ({median / base:.2f}x dynamic)   "
              f"compile-phase {compile_s[name]:6.1f} CPU-s")  # fmt: skip


if __name__ == "__main__":
    main()
