"""What a checkpoint save costs the training loop: ``checkpoint.async_save=true`` vs the synchronous save vs no
save, on the GPT-2 124M shape (12 layers, d=768, vocab 50304; 1 sample of ``--seq-len`` tokens per step) on the
CPU, as ``pretrain fit`` trains it (every callback, the guards' snapshot at a checkpoint included).

Each run is a fresh process that saves ``last.ckpt`` after step ``--save-at`` (or never) and clocks every step;
the window is the ``--window`` steps after the save step (their wall time holds the save on the training thread
and whatever the background write takes from it). Modes alternate within each of ``--rounds`` rounds; medians
are reported, each mode against "none" of the same rounds, plus the save step alone.

    python benchmarks/bench_async_save.py [--rounds 3] [--seq-len 256] [--save-at 4] [--window 2] [--modes none,async,async:1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"none": [], "sync": ["checkpoint.async_save=false"], "async": ["checkpoint.async_save=true"]}


def mode_overrides(mode: str) -> list[str]:
    """``none``, ``sync``, ``async`` (the default ``checkpoint.async_write_share``) or ``async:<share>``."""
    name, _, share = mode.partition(":")
    return MODES[name] + ([f"checkpoint.async_write_share={share}"] if share else [])


GPT2_124M = [  # configs/model/gpt2-124m.yaml's shape over the tiny recipe's model section
    "model.vocab_size=50304",
    "model.d_model=768",
    "model.n_layer=12",
    "model.n_head=12",
    "model.d_ff=3072",
    "model.max_seq_len=1024",
    "model.dropout=0.0",
]


def child(mode: str, work: Path, seq_len: int, save_at: int, window: int, out: Path) -> None:
    """One run in this process: wall clock after every optimizer step -> ``out`` (JSON)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from step_timing import corpus_overrides, fit_clocks

    steps = save_at + window + 1
    overrides = [
        *corpus_overrides(work, f"run-{mode.replace(':', '-')}"),
        *GPT2_124M,
        f"data.seq_len={seq_len}",
        "data.micro_batch_size=1",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=1",
        "trainer.progress_bar=false",
        "checkpoint.save_top_k=0",
        f"checkpoint.every_n_steps={save_at if mode != 'none' else 10 * steps}",
        *mode_overrides(mode),
    ]
    times = fit_clocks(overrides)
    out.write_text(json.dumps([t[0] for t in times]))


def window_seconds(times: list[float], save_at: int, window: int) -> tuple[float, float]:
    """(wall seconds of the ``window`` steps after step ``save_at``, of the first of them alone).
    ``times[i]`` is the clock at the end of step i + 1, read before that step's save."""
    return times[save_at + window - 1] - times[save_at - 1], times[save_at] - times[save_at - 1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="modes to run (none always): none, sync, async, async:<checkpoint.async_write_share>",
    )
    parser.add_argument("--child", nargs=3, metavar=("MODE", "WORK", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.window >= args.save_at:
        parser.error(
            f"--window {args.window} must be below --save-at {args.save_at}: the next save (every --save-at steps) "
            f"would fall in the window and wait for this one"
        )
    if args.child:
        mode, work, out = args.child
        return child(mode, Path(work), args.seq_len, args.save_at, args.window, Path(out))

    sys.path.insert(0, str(Path(__file__).parent))
    from step_timing import prepare_corpus

    modes = ["none", *(m for m in args.modes.split(",") if m.partition(":")[0] in MODES and m != "none")]
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_corpus(work)
        env = {**os.environ, "WANDB_MODE": "disabled"}
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                out = work / f"{mode}-{r}.json"
                command = [sys.executable, __file__, "--child", mode, str(work), str(out)]
                command += [
                    f"--seq-len={args.seq_len}",
                    f"--save-at={args.save_at}",
                    f"--window={args.window}",
                ]
                subprocess.run(
                    command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                results[mode].append(window_seconds(json.loads(out.read_text()), args.save_at, args.window))
                print(
                    f"round {r} {mode}: window {results[mode][-1][0]:.2f} s, save step {results[mode][-1][1]:.2f} s"
                    f"  (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    base_window = statistics.median(w for w, _ in results["none"])
    base_step = statistics.median(s for _, s in results["none"])
    print(
        f"\nGPT-2 124M shape, {args.seq_len} tokens/step, window of {args.window} steps after the save at step "
        f"{args.save_at}, median of {args.rounds} rounds, load {os.getloadavg()}"
    )
    print(f"{'mode':<9} {'window s':>9} {'window ratio':>13} {'save step s':>12} {'save step ratio':>16}")
    for mode, rows in results.items():
        w, s = statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)
        print(f"{mode:<9} {w:>9.2f} {w / base_window:>13.3f} {s:>12.2f} {s / base_step:>16.3f}")
    return None


if __name__ == "__main__":
    main()
