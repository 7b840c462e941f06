"""Cost of evaluation during fit, per task, against its peers measured in the same run.

A tiny GPT (``model/gpt-tiny`` sizes: 4 layers, d_model 128) is trained on the shipped corpus with
``eval_during_fit`` on real ICL tasks (``--data-root``, default ``$PRETRAIN_SHARED_DATA``), then
``pretrain evaluate`` scores the final checkpoint on the same tasks. Printed per task: the in-loop seconds (the
``eval/<task>/seconds`` logged at the last step), the seconds ``pretrain evaluate`` took on it, and the in-loop
evaluation's cost in training steps (its seconds over the median training-step time of the run).

    python benchmarks/bench_in_loop_eval.py [--tasks copa,piqa,lambada_openai] [--limit 100] [--steps 20]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from pretrain.cli import main as cli
from pretrain.datamodules.prepare import prepare
from pretrain.datamodules.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "recipes" / "data" / "tinyshakespeare.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="copa,piqa,lambada_openai")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--data-root", default=os.environ.get("PRETRAIN_SHARED_DATA", str(ROOT.parent / "shared" / "data"))
    )
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = tmp / "tokenizer.json"
        train_bpe([CORPUS], 1024, tokenizer, show_progress=False)
        prepare([CORPUS], tokenizer, tmp / "data", progress=False)
        recipe = {
            "defaults": ["model/gpt-tiny", "objective/clm", "optim/tiny", "trainer/cpu"],
            "run_dir": str(tmp / "run"),
            "tokenizer": {"path": str(tokenizer)},
            "data": {"sources": [{"prepared": str(tmp / "data")}], "seq_len": 128, "micro_batch_size": 8},
            "trainer": {
                "max_steps": args.steps,
                "val_check_interval": args.steps,
                "limit_val_batches": 2,
                "log_every_n_steps": 1,
                "progress_bar": False,
            },
            "logger": {"wandb": {"enabled": False}, "csv": True},
            "checkpoint": {"every_n_steps": args.steps, "save_top_k": 0},
            "eval_during_fit": {
                "tasks": tasks,
                "every_n_steps": args.steps,
                "limit": args.limit,
                "data_root": args.data_root,
            },
        }
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        cli(["fit", str(tmp / "recipe.yaml")])
        with open(next((tmp / "run" / "logs").glob("version_*/metrics.csv")), newline="") as f:
            rows = list(csv.DictReader(f))
        logged = {k: float(v) for r in rows for k, v in r.items() if k.startswith("eval/") and v}
        times = [float(r["train/seconds"]) for r in rows if r.get("train/seconds")]
        step = statistics.median(b - a for a, b in itertools.pairwise(times) if b > a)
        seconds = {}
        for task in tasks:
            began = time.perf_counter()
            cli(
                [
                    "evaluate",
                    str(tmp / "run" / "checkpoints" / "last.ckpt"),
                    "--tasks",
                    task,
                    "--limit",
                    str(args.limit),
                    "--data-root",
                    args.data_root,
                    "--device",
                    "cpu",
                    "--output",
                    str(tmp / "e.json"),
                ]
            )
            seconds[task] = time.perf_counter() - began
            ref = json.loads((tmp / "e.json").read_text())["results"][task]["metrics"]
            assert all(abs(logged[f"eval/{task}/{m}"] - v) <= 1e-6 * max(1, abs(v)) for m, v in ref.items())
    print(f"\nload average {os.getloadavg()[0]:.1f}; training step (median) {step:.3f} s")
    print(
        "| task | examples | in-loop s | pretrain evaluate s | in-loop / evaluate | in-loop in training steps |"
    )
    print("|---|---|---|---|---|---|")
    for task in tasks:
        s = logged[f"eval/{task}/seconds"]
        print(
            f"| {task} | {args.limit} | {s:.1f} | {seconds[task]:.1f} | {s / seconds[task]:.2f} | {s / step:.0f} |"
        )
    print(
        f"| all | | {logged['eval/seconds']:.1f} | {sum(seconds.values()):.1f} | | eval/core {logged['eval/core']:.4f} |"
    )


if __name__ == "__main__":
    main()
