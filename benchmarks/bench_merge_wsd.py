"""Checkpoint averaging under the WSD schedule (warmup, stable, decay: ``optim.schedule=wsd``; MiniCPM, Hu et al.
2024), on the tiny GPT of ``recipes/gpt-tiny.yaml`` (Tiny Shakespeare, 300 steps, the learning rate constant from
step 30 to 240 and decayed linearly to 10 % over the last 60): the validation loss of

- the stable phase's last checkpoint (step 240, before the decay),
- the merge of the stable phase's last ``--k`` checkpoints (every 20 steps up to 240, uniform weights),
- the decayed run's final checkpoint (step 300),
- the EMA of the weights at step 300 (``ema.decay``; its weights put in a checkpoint of their own),

all on the whole validation split, each a ``pretrain validate`` (the fit itself validates on 8 batches, at every
checkpoint).

    python benchmarks/bench_merge_wsd.py [--k 4] [--ema-decay 0.98] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "recipes" / "gpt-tiny.yaml"


def pretrain(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pretrain", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"pretrain {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def val_loss(stdout: str) -> float:
    return float(
        next(line.split(":")[1] for line in stdout.splitlines() if line.strip().startswith("val/loss:"))
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=4, help="stable-phase checkpoints merged (every 20 steps)")
    parser.add_argument("--ema-decay", type=float, default=0.98)
    parser.add_argument("--work", help="directory for the run (kept; default: a temporary one)")
    args = parser.parse_args()
    import torch

    from pretrain.checkpoint.convert import load_model
    from pretrain.checkpoint.io import read
    from pretrain.checkpoint.merge import merge

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        data = [f"tokenizer.path={work / 'tokenizer.json'}", f"data.sources.0.prepared={work / 'data'}"]
        if not (work / "data").is_dir():
            pretrain("tokenizer", str(RECIPE), *data)
            pretrain("prepare", str(RECIPE), *data)
        run = [
            *data,
            f"run_dir={work / 'run'}",
            "optim.schedule=wsd",
            "trainer.val_check_interval=20",
            "checkpoint.save_top_k=-1",
            f"ema.decay={args.ema_decay}",
            "logger.wandb.enabled=false",
        ]
        if not (work / "run" / "checkpoints" / "last.ckpt").exists():
            pretrain("fit", str(RECIPE), *run)
        checkpoints = work / "run" / "checkpoints"
        steps = list(range(240 - 20 * (args.k - 1), 241, 20))
        stable = [next(checkpoints.glob(f"best-step{s}-*.ckpt")) for s in steps]
        merged = merge(stable, checkpoints / "merged.ckpt")
        averaged, _, _ = load_model(
            checkpoints / "last.ckpt", ema=True
        )  # a tied weight once; buffers as trained
        final = read(checkpoints / "last.ckpt")
        final["state_dict"] = {f"model.{k}": v for k, v in averaged.state_dict().items()}
        torch.save(final, checkpoints / "ema.ckpt")
        rows = {}
        for label, ckpt in (
            ("stable phase, last checkpoint (step 240)", stable[-1]),
            (f"merge of the stable phase's last {args.k} (steps {steps[0]}-240)", merged),
            ("decayed run, final (step 300)", checkpoints / "last.ckpt"),
            (f"EMA of the weights at step 300 (ema.decay={args.ema_decay})", checkpoints / "ema.ckpt"),
        ):
            whole = "trainer.limit_val_batches=null"
            rows[label] = val_loss(pretrain("validate", str(RECIPE), *run, whole, "--ckpt", str(ckpt)))
    print(f"tiny GPT, WSD (stable 30-240, decay 240-300), whole validation split; load {os.getloadavg()}")
    for label, loss in rows.items():
        print(f"  {label:62} val/loss {loss:.4f}")


if __name__ == "__main__":
    main()
