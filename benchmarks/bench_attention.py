"""Attention cost vs sequence length: dense SDPA, flex-dense and flex-sparse (BigBird-style), one process.

One attention call on q, k, v of shape (1, h, T, d_h) (batch 1, h = 4, d_h = 32) through
``pretrain.models.attention.attend`` with an encoder key-padding mask (every key real, so the mask is explicit):
- sdpa:        ``F.scaled_dot_product_attention`` with the dense (1, 1, T, T) bool mask;
- flex-dense:  compiled ``flex_attention`` with the BlockMask of the same mask (no tile is skipped);
- flex-sparse: compiled ``flex_attention`` with window |q - k| < 256, 128 global tokens and 2 random blocks of
               128 per query block added to the same mask (fully masked tiles skipped); ``--window``,
               ``--global-tokens``, ``--random-blocks`` and ``--block-size`` change the pattern.
Times: median of ``--repeats`` calls after a warm-up (which also compiles); masks are built outside the timing
(a stack builds one per forward, shared by its layers). On CPU flex_attention has no backward (torch 2.13), so
flex is timed forward-only and SDPA both forward-only and forward+backward. Peak memory: the largest rise of the
process's resident set during a call (sampled every 0.5 ms), in MiB. Printed: a table and the growth ratios
cost(T_max) / cost(T_min) (dense attention grows ~ (T_max / T_min)^2, a fixed per-query budget ~ T_max / T_min).

    python benchmarks/bench_attention.py [--lengths 1024 2048 4096 8192 16384] [--repeats 3] [--threads 2]
                                         [--window 256] [--global-tokens 128] [--random-blocks 2] [--block-size 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable

import torch

from pretrain.models.attention import AttentionMask, MaskInputs, SparsePattern, attend

H, DH = 4, 32
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds, peak RSS rise in MiB) over ``repeats`` calls after one warm-up call."""
    fn()
    times, peak = [], 0
    for _ in range(repeats):
        base, top, done = rss(), [0], threading.Event()

        def sample(top: list[int] = top, done: threading.Event = done) -> None:
            while not done.is_set():
                top[0] = max(top[0], rss())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        done.set()
        sampler.join()
        peak = max(peak, top[0] - base)
    return statistics.median(times), peak / 2**20


def row(T: int, repeats: int, pattern: SparsePattern) -> dict[str, tuple[float, float]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, DH, generator=g) for _ in range(3))
    x = torch.zeros(1, T, 1)  # stands for the stack input: device, no gradients -> flex
    real = torch.ones(1, T, dtype=torch.bool)
    dense_inputs = MaskInputs(T, T, key_mask=real)
    sparse_inputs = MaskInputs(T, T, key_mask=real, pattern=pattern)
    sdpa = AttentionMask(dense_inputs, "sdpa", x)
    flex_dense = AttentionMask(dense_inputs, "flex", x)
    flex_sparse = AttentionMask(sparse_inputs, "flex", x)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def sdpa_train() -> None:
        attend(qg, kg, vg, sdpa, None, 0.0).sum().backward()

    out = {}
    with torch.no_grad():
        out["sdpa fwd"] = measure(lambda: attend(q, k, v, sdpa, None, 0.0), repeats)
    out["sdpa fwd+bwd"] = measure(sdpa_train, repeats)
    with torch.no_grad():
        out["flex-dense fwd"] = measure(lambda: attend(q, k, v, flex_dense, None, 0.0), repeats)
        out["flex-sparse fwd"] = measure(lambda: attend(q, k, v, flex_sparse, None, 0.0), repeats)
        ref = attend(q, k, v, AttentionMask(sparse_inputs, "sdpa", x), None, 0.0)
        err = (attend(q, k, v, flex_sparse, None, 0.0) - ref).abs().max().item()
    print(f"  T={T}: flex-sparse vs SDPA on the same mask, max |diff| = {err:.2e}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--global-tokens", type=int, default=128)
    parser.add_argument("--random-blocks", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    pattern = SparsePattern(False, args.window, args.global_tokens, args.random_blocks, args.block_size)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one compile per (mask, length); the default is 8
    warnings.filterwarnings("ignore", category=UserWarning)
    start = time.perf_counter()
    rows = {}
    for T in args.lengths:
        rows[T] = row(T, args.repeats, pattern)
    names = list(rows[args.lengths[0]])
    print(f"\nattention, batch 1, h={H}, d_h={DH}, {args.threads} threads, sparse {pattern}; ms (peak MiB)")
    print("| T | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for T, r in rows.items():
        print(f"| {T} | " + " | ".join(f"{r[n][0] * 1e3:.0f} ({r[n][1]:.0f})" for n in names) + " |")
    lo, hi = args.lengths[0], args.lengths[-1]
    print(f"\ngrowth {hi} vs {lo} (time; length ratio {hi / lo:.0f}x, squared {(hi / lo) ** 2:.0f}x):")
    for n in names:
        print(f"  {n}: {rows[hi][n][0] / rows[lo][n][0]:.1f}x")
    for T, r in rows.items():
        print(f"  T={T}: flex-dense / sdpa fwd = {r['flex-dense fwd'][0] / r['sdpa fwd'][0]:.2f}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
