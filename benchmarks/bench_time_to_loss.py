"""Time to the same loss, side by side in one run, same thread count, CPU clock.

1. ``shakespeare``: nanoGPT's own ``train.py`` on its documented CPU recipe (character-level Tiny Shakespeare,
   4 layers, 4 heads, d=128, context 64, batch 12, AdamW lr 1e-3, ``--iters`` iterations, no dropout) against
   ``pretrain fit`` of the same model size on the same text: the AdamW baseline recipe and the fast recipe
   (Muon + muP + warmup-stable-decay + QK-norm + ReLU^2 + untied head + zero-init projections). Characters are
   tokens for both: nanoGPT's 65-symbol vocabulary, our byte-level tokenizer without merges (the corpus is
   ASCII, so one byte = one character and nats/token are nats/char for both). Validation: nanoGPT's own split
   (the last 10 % of the characters) for both -- nanoGPT reports it itself (``eval_iters`` random batches);
   ``pretrain fit`` runs as the CLI runs it plus a callback that scores every non-overlapping 64-character
   window of that split every ``--eval-every`` steps, its scoring time subtracted (start-up, the trainer's own
   validation and checkpoint writing count against us). Tokenizing (``pretrain prepare``, nanoGPT's
   ``prepare.py``) is not timed.
2. Not implemented yet: WikiText-2 (BPE) fast recipe vs the AdamW baseline in steps and time (issue 18 goal 4).

Reports, per seed, the wall and CPU time each side takes to reach nanoGPT's final validation loss (and the
ratio, target <= 0.6), the median over seeds, and a loss-vs-wall-time plot.

    python benchmarks/bench_time_to_loss.py --nanogpt DIR [--iters 2000] [--seeds 1] [--threads 2]
        [--eval-every 250] [--plot docs/time_to_loss.png] [--work DIR]

DIR holds nanoGPT's ``train.py``, ``model.py`` and ``configurator.py`` (``git clone
https://github.com/karpathy/nanoGPT``); nanoGPT seeds itself (1337), so its run is the same for every seed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "recipes" / "data" / "tinyshakespeare.txt"  # = karpathy/char-rnn tinyshakespeare/input.txt
SIZE = {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512, "max_seq_len": 64}
FAST_MODEL = {
    "parametrization": "mup",
    "mup_base_width": 128,
    "qk_norm": True,
    "activation": "relu2",
    "tie_embeddings": False,
    "zero_init_projections": True,
}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(
    cmd: list[str], cwd: Path, threads: int, log: Path
) -> tuple[float, float, list[tuple[float, str]]]:
    """Run ``cmd``; (wall s, CPU s, [(seconds since launch, stdout line)])."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    cpu0, start, lines = cpu_seconds(), time.monotonic(), []
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as p:
        for line in p.stdout:
            lines.append((time.monotonic() - start, line.rstrip()))
    log.write_text("\n".join(f"{t:8.2f} {line}" for t, line in lines))
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}; see {log}")
    return time.monotonic() - start, cpu_seconds() - cpu0, lines


# ------------------------------------------------------------------------------------------------ nanoGPT
def nanogpt_data(nanogpt: Path) -> tuple[str, str]:
    """nanoGPT's data/shakespeare_char/prepare.py on the shipped corpus: train.bin, val.bin, meta.pkl."""
    data = CORPUS.read_text()
    chars = sorted(set(data))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(data)
    train, val = data[: int(n * 0.9)], data[int(n * 0.9) :]
    out = nanogpt / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("val", val)):
        np.array([stoi[c] for c in text], dtype=np.uint16).tofile(out / f"{name}.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return train, val


def run_nanogpt(nanogpt: Path, args: argparse.Namespace, work: Path) -> dict:
    """nanoGPT README's CPU command, evaluating every ``--eval-every`` iterations."""
    cmd = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        "--device=cpu",
        "--compile=False",
        "--eval_iters=20",
        "--log_interval=1",
        "--block_size=64",
        "--batch_size=12",
        "--n_layer=4",
        "--n_head=4",
        "--n_embd=128",
        f"--max_iters={args.iters}",
        f"--lr_decay_iters={args.iters}",
        "--dropout=0.0",
        f"--eval_interval={args.eval_every}",
        f"--out_dir={work / 'nanogpt-out'}",
    ]
    cached = work / "nanogpt.json"
    if args.reuse_nanogpt and cached.exists():
        return json.loads(cached.read_text())
    wall, cpu, lines = launch(cmd, nanogpt, args.threads, work / "nanogpt.log")
    curve = []
    for t, line in lines:
        if m := re.match(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", line):
            curve.append((t, int(m[1]), float(m[3])))
    result = {"wall": wall, "cpu": cpu, "curve": curve}
    cached.write_text(json.dumps(result))
    return result


# ------------------------------------------------------------------------------------------------ pretrain
def char_tokenizer(work: Path, train: str, threads: int) -> Path:
    """A byte-level tokenizer with no merges (256 bytes + the 110 special tokens and sentinels): one token per
    ASCII character."""
    (work / "train.txt").write_text(train)
    recipe = work / "tok.yaml"
    path = work / "bytes.json"
    recipe.write_text(
        yaml.safe_dump(
            {"tokenizer": {"path": str(path), "train_files": [str(work / "train.txt")], "vocab_size": 366}}
        )
    )
    launch(["pretrain", "tokenizer", str(recipe)], REPO, threads, work / "tokenizer.log")
    return path


def pretrain_recipe(
    work: Path, name: str, tokenizer: Path, fast: bool, args: argparse.Namespace, seed: int
) -> Path:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    model = {
        **SIZE,
        "vocab_size": vocab,
        "attn_bias": False,
        "mlp_bias": False,
        "norm_bias": False,
        "dropout": 0.0,
        **(FAST_MODEL if fast else {}),
    }
    optim = {
        "name": "adamw",
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "weight_decay": 0.1,
        "schedule": "cosine",
        "warmup_steps": 100,
        "min_lr_ratio": 0.1,
    }  # nanoGPT's train_shakespeare_char settings
    if fast:
        optim = {
            "name": "muon",
            "muon": {"lr": args.muon_lr},
            "lr": 3e-3,
            "weight_decay": 0.0,
            "schedule": "wsd",
            "cooldown_fraction": 0.3,
            "warmup_steps": 0,
            "min_lr_ratio": 0.0,
        }
    body = {
        "defaults": ["objective/clm", "trainer/cpu"],
        "name": name,
        "seed": seed,
        "run_dir": str(work / name),
        "resume": None,
        "model": model,
        "tokenizer": {"path": str(tokenizer)},
        "data": {
            "sources": [
                {
                    "name": "shakespeare",
                    "text": [str(work / "train.txt")],
                    "prepared": str(work / "prepared"),
                    "document": "blank_line",
                }
            ],
            "seq_len": 64,
            "micro_batch_size": 12,
            "val_fraction": 0.01,
        },
        "optim": optim,
        "trainer": {
            "max_steps": args.iters,
            "val_check_interval": args.iters,
            "limit_val_batches": 1,
            "log_every_n_steps": 50,
            "progress_bar": False,
        },
        "checkpoint": {"every_n_steps": args.iters, "save_top_k": 0},
        "logger": {"wandb": {"enabled": False}, "csv": True},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


@torch.no_grad()
def score(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Mean next-character loss (nats) over every non-overlapping 64-token window of ``ids``."""
    was_training = model.training
    model.eval()
    n = (len(ids) - 1) // 64 * 64
    x, y = ids[:n].view(-1, 64), ids[1 : n + 1].view(-1, 64)
    total = 0.0
    for i in range(0, len(x), 256):
        logits = model(x[i : i + 256]).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), y[i : i + 256].flatten(), reduction="sum"))
    model.train(was_training)
    return total / y.numel()


def driver(recipe: str, val_text: str, every: int) -> None:
    """``pretrain fit RECIPE`` as the CLI runs it, plus a callback that scores the model on ``val_text`` every
    ``every`` steps and prints ``EVAL step loss excluded_seconds`` (the scoring time, not counted)."""
    from lightning.pytorch.callbacks import Callback
    from tokenizers import Tokenizer

    from pretrain import config
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    run, resolved = config.load(recipe, [])
    ids = torch.tensor(Tokenizer.from_file(run.tokenizer.path).encode(Path(val_text).read_text()).ids)
    excluded = 0.0

    class Score(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            nonlocal excluded
            step = trainer.global_step
            if step % every == 0 or step == run.trainer.max_steps:
                t0 = time.monotonic()
                loss = score(pl_module.model, ids)
                excluded += time.monotonic() - t0
                print(f"EVAL {step} {loss:.5f} {excluded:.3f}", flush=True)

    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved, callbacks=[Score()])
    trainer.fit(parts["module"], datamodule=parts["datamodule"])


def run_pretrain(recipe: Path, work: Path, name: str, threads: int, every: int) -> dict:
    for verb in ("prepare",):  # tokenizing the corpus is outside the timed run (nanoGPT's prepare.py too)
        launch(["pretrain", verb, str(recipe)], REPO, threads, work / f"{name}.{verb}.log")
    cmd = [sys.executable, __file__, "--driver", str(recipe), str(work / "val.txt"), str(every)]
    wall, cpu, lines = launch(cmd, REPO, threads, work / f"{name}.log")
    curve, excluded = [], 0.0
    for t, line in lines:
        if m := re.match(r"EVAL (\d+) ([\d.]+) ([\d.]+)", line):
            excluded = float(m[3])
            curve.append((t - excluded, int(m[1]), float(m[2])))
    return {"wall": wall - excluded, "cpu": cpu, "curve": curve}


def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(seconds, step) of the first evaluation at or below ``target``."""
    return next(((t, s) for t, s, loss in curve if loss <= target), None)


def shakespeare(args: argparse.Namespace, work: Path) -> dict:
    nanogpt = work / "nanoGPT"
    shutil.copytree(args.nanogpt, nanogpt, ignore=shutil.ignore_patterns(".git", "data"), dirs_exist_ok=True)
    train, val = nanogpt_data(nanogpt)
    (work / "val.txt").write_text(val)
    tokenizer = char_tokenizer(work, train, args.threads)
    results = {"nanogpt": run_nanogpt(nanogpt, args, work)}
    target = results["nanogpt"]["curve"][-1][2]
    for seed in range(args.seeds):
        for fast in (False, True):
            name = f"{'fast' if fast else 'adamw'}-seed{seed}"
            recipe = pretrain_recipe(work, name, tokenizer, fast, args, 1337 + seed)
            results[name] = run_pretrain(recipe, work, name, args.threads, args.eval_every)
    report = {"target_val_loss": target, "runs": results, "ratios": {}}
    nano = time_to(results["nanogpt"]["curve"], target)
    for kind in ("adamw", "fast"):
        ratios = []
        for seed in range(args.seeds):
            hit = time_to(results[f"{kind}-seed{seed}"]["curve"], target)
            ratios.append(hit[0] / nano[0] if hit else float("inf"))
        report["ratios"][kind] = {"per_seed": ratios, "median": statistics.median(ratios)}
    return report


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in report["runs"].items():
        if run["curve"]:
            t, _, loss = zip(*run["curve"])
            ax.plot(t, loss, marker=".", label=name)
    ax.axhline(report["target_val_loss"], color="grey", ls="--", lw=0.8, label="nanoGPT final val loss")
    ax.set(xlabel="wall seconds since launch", ylabel="val loss (nats/char)", ylim=(None, 3.0))
    ax.set_title("Tiny Shakespeare (char), nanoGPT CPU recipe size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="directory with nanoGPT's train.py")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "time_to_loss.png")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--reuse-nanogpt", action="store_true", help="reuse the nanoGPT run found in --work")
    p.add_argument(
        "--work", type=Path, default=None, help="keep the runs here (default: a temporary directory)"
    )
    if sys.argv[1:2] == ["--driver"]:
        return driver(*sys.argv[2:4], int(sys.argv[4]))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = shakespeare(args, work)
    for name, run in report["runs"].items():
        print(
            f"{name:<14} wall {run['wall']:7.1f} s  cpu {run['cpu']:7.1f} s  final val {run['curve'][-1][2]:.4f}"
        )
    print(f"target (nanoGPT final val loss): {report['target_val_loss']:.4f}")
    for kind, r in report["ratios"].items():
        met = "met" if r["median"] <= 0.6 else "NOT met"
        print(
            f"time to target, pretrain {kind} / nanoGPT: median {r['median']:.2f}x ({met}; target <= 0.6x) "
            f"per seed {[round(x, 2) for x in r['per_seed']]}"
        )
    plot(report, args.plot)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"plot: {args.plot}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
