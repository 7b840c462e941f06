"""Lightning overhead: optimizer steps/s of ``PretrainModule`` under ``Trainer.fit`` vs a plain PyTorch loop.

Both sides train the same GPT model (same initial weights), on the same batches of the same datamodule, with
the same globally normalised loss, AdamW groups, schedule and gradient clipping, in the same process; they
alternate for several rounds and the median steps/s of each side is compared (target: <= 3% overhead).
Steps are timed by the wall clock and by the process CPU clock: on a shared machine the CPU clock (steps per
CPU-second = steps/s on a dedicated core, with ``--threads 1``) is the stable figure.
The Lightning side runs as ``pretrain fit`` does: the CSV logger, throughput/MFU monitor, checkpoint
callbacks (interval beyond the run), metrics every 10 steps (loss, accuracy, gradient norm, tokens, lr).

    python benchmarks/bench_lightning_overhead.py [--steps 40] [--rounds 3] [--d-model 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from pretrain.datamodules.prepare import prepare
from pretrain.datamodules.tokenizer import train_bpe

from pretrain import config
from pretrain.training.module import STEP_TARGETS
from pretrain.training.optim import build_optimizer, build_scheduler
from pretrain.training.setup import build_data, prepare_run
from pretrain.training.trainer import build_loggers, build_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps excluded from the timing (allocator warm-up, first-call costs)


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class StepClock(Callback):
    """Wall and CPU time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, *_) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.times.append(now())


def steps_per_second(times: list[tuple[float, float]]) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second) after the warm-up steps."""
    n = len(times) - 1 - WARMUP
    return n / (times[-1][0] - times[WARMUP][0]), n / (times[-1][1] - times[WARMUP][1])


def overrides(work: Path, args: argparse.Namespace, tag: str) -> list[str]:
    return [
        f"tokenizer.path={work / 'tokenizer.json'}",
        f"data.sources.0.prepared={work / 'data'}",
        f"run_dir={work / tag}",
        "resume=null",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={10 * args.steps}",
        f"checkpoint.every_n_steps={10 * args.steps}",
        "trainer.progress_bar=false",
        "logger.wandb.enabled=false",
        f"model.d_model={args.d_model}",
        f"model.d_ff={4 * args.d_model}",
        "model.dropout=0.0",
        f"data.micro_batch_size={args.batch}",
        f"data.seq_len={args.seq_len}",
    ]


def lightning_run(work: Path, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    run, resolved = config.load(REPO_ROOT / "recipes" / "gpt-tiny.yaml", overrides(work, args, tag))
    parts = prepare_run(run, resolved)
    clock = StepClock()
    trainer = build_trainer(run, resolved, callbacks=[clock], loggers=build_loggers(run, resolved, None))
    trainer.fit(parts["module"], datamodule=parts["datamodule"])
    return steps_per_second(clock.times)


def plain_run(work: Path, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    """The same step by hand: forward, sum of token losses / targets, backward, clip, AdamW, schedule."""
    run, resolved = config.load(REPO_ROOT / "recipes" / "gpt-tiny.yaml", overrides(work, args, tag))
    parts = prepare_run(run, resolved)
    model, objective = parts["module"].model, parts["module"].objective
    optimizer = build_optimizer(model, run.optim)
    scheduler = build_scheduler(optimizer, run.optim, run.trainer.max_steps)
    data = build_data(run, objective, parts["tokenizer"])
    model.train()
    times = []
    for step, batch in enumerate(data.train_dataloader()):
        if step == args.steps:
            break
        batch = data.on_before_batch_transfer(batch, 0)  # as under Lightning: all-ones masks dropped
        batch.pop(STEP_TARGETS)
        labels = batch.pop("labels")
        loss_sum, n = objective.loss(model(**batch).logits, labels)
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        times.append(now())
    return steps_per_second(times)


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
        corpus = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"
        train_bpe([corpus], 1024, work / "tokenizer.json", min_frequency=2, show_progress=False)
        prepare([corpus], work / "tokenizer.json", work / "data", val_fraction=0.05, progress=False)
        results: dict[str, list[tuple[float, float]]] = {"plain": [], "lightning": []}
        for r in range(args.rounds):
            results["plain"].append(plain_run(work, args, f"plain{r}"))
            results["lightning"].append(lightning_run(work, args, f"lightning{r}"))
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
