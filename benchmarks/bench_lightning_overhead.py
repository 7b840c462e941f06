"""Lightning overhead: optimizer steps/s of ``PretrainModule`` under ``Trainer.fit`` vs a plain PyTorch loop.

Both sides train the same GPT model (same initial weights), on the same batches of the same datamodule, with
the same globally normalised loss, AdamW groups, schedule and gradient clipping, in the same process; they
alternate for several rounds and the median steps/s of each side is compared (target: <= 3% overhead).
Steps are timed by the wall clock and by the process CPU clock: on a shared machine the CPU clock (steps per
CPU-second = steps/s on a dedicated core, with ``--threads 1``) is the stable figure.
The Lightning side runs as ``pretrain fit`` does: the CSV logger, throughput/MFU monitor, checkpoint
callbacks (interval beyond the run), metrics every 10 steps (loss, accuracy, gradient norm, tokens, lr).
Both sides are ``step_timing.py``'s (shared with ``bench_step_overhead.py``, which times nanoGPT's model size
with guards and progress output on, and start-up).

    python benchmarks/bench_lightning_overhead.py [--steps 40] [--rounds 3] [--d-model 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from step_timing import corpus_overrides, fit_clocks, plain_clocks, prepare_corpus, rate


def overrides(work: Path, args: argparse.Namespace, tag: str) -> list[str]:
    return [
        *corpus_overrides(work, tag),
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={10 * args.steps}",
        f"checkpoint.every_n_steps={10 * args.steps}",
        "trainer.progress_bar=false",
        f"model.d_model={args.d_model}",
        f"model.d_ff={4 * args.d_model}",
        "model.dropout=0.0",
        f"data.micro_batch_size={args.batch}",
        f"data.seq_len={args.seq_len}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_corpus(work)
        results: dict[str, list[tuple[float, float]]] = {"plain": [], "lightning": []}
        for r in range(args.rounds):  # steps per second = 1 / seconds per step
            results["plain"].append(
                tuple(1 / x for x in rate(plain_clocks(overrides(work, args, f"plain{r}"))))
            )
            results["lightning"].append(
                tuple(1 / x for x in rate(fit_clocks(overrides(work, args, f"fit{r}"))))
            )
            (pw, pc), (lw, lc) = results["plain"][-1], results["lightning"][-1]
            print(f"round {r}: plain {pw:.3f} steps/s ({pc:.3f} per CPU-s), lightning {lw:.3f} ({lc:.3f})")
    print(
        f"\nGPT d_model={args.d_model}, batch {args.batch} x {args.seq_len} tokens, {args.threads} threads, "
        f"{args.steps} steps x {args.rounds} rounds (medians)"
    )
    for i, clock in enumerate(("wall clock", "CPU clock")):
        plain, lightning = (statistics.median(x[i] for x in results[k]) for k in ("plain", "lightning"))
        print(
            f"{clock:>10}: plain loop {plain:.3f} steps/s, Lightning Trainer.fit {lightning:.3f} steps/s; "
            f"Lightning / plain = {lightning / plain:.3f} (overhead {100 * (plain / lightning - 1):+.1f}%; target <= 3%)"
        )


if __name__ == "__main__":
    main()
