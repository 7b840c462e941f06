"""Time to the same loss, side by side in one run, same thread count, CPU clock.

1. ``shakespeare``: nanoGPT's own ``train.py`` on its documented CPU recipe (character-level Tiny Shakespeare,
   4 layers, 4 heads, d=128, context 64, batch 12, AdamW lr 1e-3, ``--iters`` iterations, no dropout) against
   ``pretrain fit`` of the same model size on the same split: the AdamW baseline (nanoGPT's settings, batch 12,
   ``--iters`` steps) and the fast recipe (Muon + muP + warmup-stable-decay + QK-norm + ReLU^2 + untied head +
   zero-init projections; batch ``--fast-batch``, ``--fast-iters`` steps). Characters are tokens for both:
   nanoGPT's 65-symbol vocabulary, our byte-level tokenizer without merges (the corpus is ASCII). The training
   text is one document for both (nanoGPT's ``train.bin``: no EOS inserted, blank lines kept). Validation is
   nanoGPT's split (the last 10 %), every non-overlapping 64-character window scored the same way for both
   (``score``): nanoGPT's final checkpoint sets the target (nanoGPT's own estimate, 20 random batches, is
   printed beside it); ``pretrain fit`` runs as the CLI runs it plus a callback that scores every
   ``--eval-every`` steps, its scoring time subtracted (start-up and checkpoint writing count against us).
   Ratio: our wall time to the target / nanoGPT's wall time, nanoGPT run again in every round (seed).
2. ``wikitext``: WikiText-2 (train on ``valid.txt`` -- only valid/test are shipped --, validate on the first
   ``--wt-val-tokens`` of ``test.txt``), byte-level BPE of ``--wt-vocab`` ids, the same model size with a tied
   head on both sides (equal parameter count): the fast recipe (``--wt-fast-fraction`` of the steps) against
   the AdamW baseline; ratios of optimizer steps and of wall time to the baseline's final validation loss.
   Skipped with a message when the shared data (``--data``, ``$PRETRAIN_SHARED_DATA``) is absent.

Tokenizing (``pretrain prepare``, nanoGPT's ``prepare.py``) is not timed. Reports per seed and the median
(target <= 0.6x) and one figure of loss vs wall time (``--plot``).

    python benchmarks/bench_time_to_loss.py --nanogpt DIR [--seeds 3] [--threads 2] [--suites shakespeare,wikitext]

DIR holds nanoGPT's ``train.py``, ``model.py`` and ``configurator.py`` (``git clone
https://github.com/karpathy/nanoGPT``).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "recipes" / "data" / "tinyshakespeare.txt"  # = karpathy/char-rnn tinyshakespeare/input.txt
SIZE = {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512}  # nanoGPT's CPU recipe (README)
ADAMW = {  # nanoGPT's config/train_shakespeare_char.py
    "name": "adamw",
    "lr": 1e-3,
    "betas": [0.9, 0.99],
    "weight_decay": 0.1,
    "schedule": "cosine",
    "warmup_steps": 100,
    "min_lr_ratio": 0.1,
}
FAST_RECIPE = REPO / "recipes" / "gpt-tiny-fast.yaml"


def fast_recipe() -> tuple[dict, dict, int, int]:
    """The fast recipe as ``recipes/gpt-tiny-fast.yaml`` ships it: its own model section (the options it sets over
    ``model/gpt-tiny``), its optim section composed with ``optim/muon``, its batch and its steps."""
    from pretrain.config.compose import compose

    resolved = compose(FAST_RECIPE)
    model = yaml.safe_load(FAST_RECIPE.read_text())["model"]
    return model, resolved["optim"], resolved["data"]["micro_batch_size"], resolved["trainer"]["max_steps"]


FAST_MODEL, FAST_OPTIM, FAST_BATCH, FAST_ITERS = fast_recipe()


@dataclass
class Side:
    """One ``pretrain fit`` configuration: data (tokenizer, text, scored ids), batch, steps, recipe."""

    tokenizer: Path
    data: str
    text: list[str]
    seq_len: int
    val_ids: Path
    batch: int
    steps: int
    eval_every: int
    eval_from: int = 0  # before this step, score every 50 steps only (a cheaper curve far from the target)
    fast: bool = False
    optim: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)


def merged(base: dict, update: dict) -> dict:
    """``base`` with ``update``'s keys, nested mappings merged key by key."""
    out = dict(base)
    for key, value in update.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def fast_optim(args: argparse.Namespace) -> dict:
    return {"lr": args.fast_adam_lr, "muon": {"lr": args.muon_lr, "ns_steps": args.ns_steps}}


def override(text: str) -> tuple[str, str, object]:
    """``model.KEY=VALUE`` or ``optim.KEY=VALUE`` (``optim.muon.KEY=VALUE``), the value read as YAML."""
    key, sep, value = text.partition("=")
    section, _, name = key.partition(".")
    if not sep or section not in ("model", "optim") or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected model.KEY=VALUE or optim.KEY=VALUE")
    return section, name, yaml.safe_load(value)


def fast_overrides(args: argparse.Namespace) -> dict[str, dict]:
    """The fast side's ``--fast-set`` overrides as nested ``{"model": {...}, "optim": {...}}``."""
    out: dict[str, dict] = {"model": {}, "optim": fast_optim(args)}
    for section, name, value in args.fast_set:
        *parents, leaf = name.split(".")
        node = out[section]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(
    cmd: list[str], cwd: Path, threads: int, log: Path
) -> tuple[float, float, list[tuple[float, str]]]:
    """Run ``cmd``; (wall s, CPU s, [(seconds since launch, stdout line)])."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    cpu0, start, lines = cpu_seconds(), time.monotonic(), []
    with (
        open(log, "w") as out,
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as p,
    ):
        for line in p.stdout:  # the log is written as the run goes (a long run can be followed)
            lines.append((time.monotonic() - start, line.rstrip()))
            out.write(f"{lines[-1][0]:8.2f} {lines[-1][1]}\n")
            out.flush()
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


def run_nanogpt(nanogpt: Path, args: argparse.Namespace, work: Path, seed: int) -> dict:
    """nanoGPT README's CPU command, evaluating every ``--eval-every`` iterations; its final checkpoint is then
    scored as ours are (``score``: every 64-character window of the split, where nanoGPT's own estimate
    averages 20 random batches), which sets the target. nanoGPT seeds itself (1337): every round trains the
    same model, only its wall time is measured again."""
    out = work / f"nanogpt-out-{seed}"
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
        "--always_save_checkpoint=True",
        f"--out_dir={out}",
    ]
    cached = work / f"nanogpt-{seed}.json"
    if args.reuse_nanogpt and cached.exists():
        return json.loads(cached.read_text())
    wall, cpu, lines = launch(cmd, nanogpt, args.threads, work / f"nanogpt-{seed}.log")
    curve = []
    for t, line in lines:
        if m := re.match(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", line):
            curve.append((t, int(m[1]), float(m[3])))
    result = {"wall": wall, "cpu": cpu, "curve": curve, "final_val": score_nanogpt(nanogpt, out / "ckpt.pt")}
    cached.write_text(json.dumps(result))
    return result


def score_nanogpt(nanogpt: Path, ckpt: Path) -> float:
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's model.py

    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()
    ids = torch.from_numpy(np.fromfile(nanogpt / "data" / "shakespeare_char" / "val.bin", dtype=np.uint16))
    return score(lambda x, y: model(x, y)[1] * y.numel(), ids.long(), 64)


# ------------------------------------------------------------------------------------------------ pretrain
def bpe_tokenizer(work: Path, name: str, files: list[str], vocab: int, threads: int) -> Path:
    """``pretrain tokenizer``: byte-level BPE of ``vocab`` ids (special tokens included) on ``files``;
    ``vocab=366`` is the 256 bytes + specials with no merges: one token per ASCII character."""
    recipe, path = work / f"{name}-tok.yaml", work / f"{name}.json"
    body = {"tokenizer": {"path": str(path), "train_files": files, "vocab_size": vocab, "min_frequency": 2}}
    recipe.write_text(yaml.safe_dump(body))
    launch(["pretrain", "tokenizer", str(recipe)], REPO, threads, work / f"{name}-tok.log")
    return path


def pretrain_recipe(work: Path, name: str, side: Side, seed: int) -> Path:
    """One ``pretrain fit`` recipe: nanoGPT's model layout (no biases, no dropout, tied head), the AdamW
    baseline (nanoGPT's train_shakespeare_char settings) or the fast recipe. The source is one document (no
    EOS inserted, blank lines kept, as nanoGPT's ``train.bin``); validation is the scoring callback's."""
    from tokenizers import Tokenizer

    model = {
        **SIZE,
        "attn_bias": False,
        "mlp_bias": False,
        "norm_bias": False,
        "dropout": 0.0,
        **(FAST_MODEL if side.fast else {}),
        **side.model,
        "max_seq_len": side.seq_len,
        "vocab_size": Tokenizer.from_file(str(side.tokenizer)).get_vocab_size(),
    }
    optim = merged(FAST_OPTIM if side.fast else ADAMW, side.optim)
    body = {
        "defaults": ["objective/clm", "trainer/cpu"],
        "name": name,
        "seed": seed,
        "run_dir": str(work / name),
        "resume": None,
        "model": model,
        "tokenizer": {"path": str(side.tokenizer)},
        "data": {
            "sources": [
                {
                    "name": side.data,
                    "text": side.text,
                    "prepared": str(work / f"prepared-{side.data}"),
                    "document": "file",
                }
            ],
            "seq_len": side.seq_len,
            "micro_batch_size": side.batch,
            "val_fraction": 0.0,
        },
        "optim": optim,
        "trainer": {
            "max_steps": side.steps,
            "limit_val_batches": 0,
            "log_every_n_steps": 50,
            "progress_bar": False,
        },
        "checkpoint": {"every_n_steps": side.steps, "save_top_k": 0},
        "logger": {"wandb": {"enabled": False}, "csv": True},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


@torch.no_grad()
def score(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ids: torch.Tensor, window: int
) -> float:
    """Mean next-token loss (nats) over every non-overlapping ``window``-token window of ``ids``;
    ``forward(x, y)`` gives the summed loss of a batch of windows."""
    n = (len(ids) - 1) // window * window
    x, y = ids[:n].view(-1, window), ids[1 : n + 1].view(-1, window)
    return sum(float(forward(x[i : i + 128], y[i : i + 128])) for i in range(0, len(x), 128)) / y.numel()


def summed_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), reduction="sum")

    return forward


def driver(recipe: str, val_ids: str, every: int, start: int) -> None:
    """``pretrain fit RECIPE`` as the CLI runs it, plus a callback that scores the model on the token ids in
    ``val_ids`` (``.npy``) every ``every`` steps (every 50 before step ``start``) and prints ``EVAL step loss excluded_seconds`` (the scoring
    time, not counted)."""
    from lightning.pytorch.callbacks import Callback

    from pretrain import config
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    run, resolved = config.load(recipe, [])
    ids = torch.from_numpy(np.load(val_ids).astype(np.int64))
    excluded = excluded_cpu = 0.0

    class Score(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            nonlocal excluded, excluded_cpu
            step = trainer.global_step
            if step % (every if step >= start else 50) == 0 or step == run.trainer.max_steps:
                t0, c0 = time.monotonic(), own_cpu_seconds()
                model = pl_module.model
                model.eval()
                loss = score(summed_loss(model), ids, run.data.seq_len)
                model.train()
                excluded += time.monotonic() - t0
                excluded_cpu += own_cpu_seconds() - c0
                cpu = own_cpu_seconds() - excluded_cpu
                print(f"EVAL {step} {loss:.5f} {excluded:.3f} {cpu:.3f}", flush=True)

    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved, callbacks=[Score()])
    trainer.fit(parts.module, datamodule=parts.datamodule)


def run_pretrain(side: Side, work: Path, name: str, seed: int, threads: int) -> dict:
    recipe = pretrain_recipe(work, name, side, seed)
    # tokenizing the corpus is outside the timed run (nanoGPT's prepare.py too); the first run prepares it
    launch(["pretrain", "prepare", str(recipe)], REPO, threads, work / f"{name}.prepare.log")
    cmd = [sys.executable, __file__, "--driver", str(recipe), str(side.val_ids)]
    cmd += [str(side.eval_every), str(side.eval_from)]
    wall, _, lines = launch(cmd, REPO, threads, work / f"{name}.log")
    curve, excluded, cpu_curve = [], 0.0, []
    for t, line in lines:
        if m := re.match(r"EVAL (\d+) ([\d.]+) ([\d.]+) ([\d.]+)", line):
            excluded = float(m[3])
            curve.append((t - excluded, int(m[1]), float(m[2])))
            cpu_curve.append((float(m[4]), int(m[1]), float(m[2])))
    return {
        "wall": wall - excluded,
        "cpu": cpu_curve[-1][0],
        "steps": side.steps,
        "batch": side.batch,
        "curve": curve,
        "cpu_curve": cpu_curve,
    }


def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(seconds, step) of the first evaluation at or below ``target``."""
    return next(((t, s) for t, s, loss in curve if loss <= target), None)


def encode(tokenizer: Path, text: str, out: Path, limit: int | None = None) -> Path:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer)).encode(text).ids[:limit]
    np.save(out, np.array(ids, dtype=np.int32))
    return out


def shakespeare(args: argparse.Namespace, work: Path) -> dict:
    """nanoGPT's train.py vs ``pretrain fit`` (AdamW baseline, fast recipe), one round per seed, interleaved."""
    nanogpt = work / "nanoGPT"
    shutil.copytree(args.nanogpt, nanogpt, ignore=shutil.ignore_patterns(".git", "data"), dirs_exist_ok=True)
    train, val = nanogpt_data(nanogpt)
    (work / "train.txt").write_text(train)
    tok = bpe_tokenizer(work, "bytes", [str(work / "train.txt")], 366, args.threads)
    common = {
        "tokenizer": tok,
        "data": "shakespeare",
        "text": [str(work / "train.txt")],
        "seq_len": 64,
        "val_ids": encode(tok, val, work / "val-ids.npy"),
    }
    baseline = Side(**common, batch=12, steps=args.iters, eval_every=args.eval_every)
    fast = Side(
        **common,
        fast=True,
        batch=args.fast_batch,
        steps=args.fast_iters,
        eval_every=args.fast_eval_every,
        eval_from=args.fast_eval_from,
        **fast_overrides(args),
    )
    runs = {}
    for seed in args.seeds:  # one round per seed: nanoGPT, then ours (--only picks the runs of this process)
        if "nanogpt" in args.only:
            runs[f"nanogpt-{seed}"] = run_nanogpt(nanogpt, args, work, seed)
        for kind, side in (("adamw", baseline), ("fast", fast)):
            if kind in args.only and (kind == "fast" or seed in args.baseline_seeds):
                name = f"shakespeare-{kind}-{seed}"
                runs[f"{kind}-{seed}"] = run_pretrain(side, work, name, 1337 + seed, args.threads)
    return {"runs": runs, "reference": "nanoGPT"}


def wikitext(args: argparse.Namespace, work: Path) -> dict | None:
    """WikiText-2 (train: valid.txt, validation: the first tokens of test.txt), BPE: the fast recipe vs the
    AdamW baseline at equal parameter count (both tie the LM head), steps and wall time to the baseline's
    final validation loss."""
    root = args.data / "lm" / "wikitext-2"
    if not (root / "valid.txt").exists():
        print(f"wikitext: skipped ({root}/valid.txt not found; --data names the shared data directory)")
        return None
    work = work / "wikitext"
    work.mkdir(exist_ok=True)
    tok = bpe_tokenizer(work, "bpe", [str(root / "valid.txt")], args.wt_vocab, args.threads)
    common = {
        "tokenizer": tok,
        "data": "wikitext2",
        "text": [str(root / "valid.txt")],
        "seq_len": args.wt_seq,
        "batch": args.wt_batch,
        "eval_every": args.wt_eval_every,
        "val_ids": encode(tok, (root / "test.txt").read_text(), work / "val-ids.npy", args.wt_val_tokens),
    }
    baseline = Side(**common, steps=args.wt_steps)
    fast = Side(
        **common,
        fast=True,
        steps=round(args.wt_steps * args.wt_fast_fraction),
        optim=fast_overrides(args)["optim"],
        model={**fast_overrides(args)["model"], "tie_embeddings": True},
    )
    runs = {}
    for seed in args.seeds:
        for kind, side in (("adamw", baseline), ("fast", fast)):
            if kind in args.only:
                name = f"wikitext-{kind}-{seed}"
                runs[f"{kind}-{seed}"] = run_pretrain(side, work, name, 1337 + seed, args.threads)
    return {"runs": runs, "reference": "AdamW"}


def with_ratios(suite: str, report: dict) -> dict:
    """Per seed, ours to the reference's final validation loss: wall and CPU seconds over the reference's
    (shakespeare: nanoGPT's run of the same round, else of the first; wikitext: the AdamW run of the same
    seed), and samples (optimizer steps x batch; on WikiText-2 the batch is equal: the ratio of steps).
    inf: the target was not reached."""
    runs = report["runs"]
    refs = sorted(k for k in runs if k.startswith("nanogpt" if suite == "shakespeare" else "adamw"))
    if not refs:
        return {**report, "target": float("nan"), "ratios": {}}
    kinds = ("adamw", "fast") if suite == "shakespeare" else ("fast",)
    ratios = {f"{k} {unit}": [] for k in kinds for unit in ("wall", "cpu", "samples")}
    for name in sorted(runs):
        kind, seed = name.rsplit("-", 1)
        if kind not in kinds:
            continue
        ref = runs.get(f"{refs[0].rsplit('-', 1)[0]}-{seed}", runs[refs[0]])
        target = ref["final_val"] if suite == "shakespeare" else ref["curve"][-1][2]
        run = runs[name]
        hit, hit_cpu = time_to(run["curve"], target), time_to(run["cpu_curve"], target)
        ref_cpu = ref["cpu"] if suite == "shakespeare" else ref["cpu_curve"][-1][0]
        ratios[f"{kind} wall"].append(hit[0] / ref["curve"][-1][0] if hit else float("inf"))
        ratios[f"{kind} cpu"].append(hit_cpu[0] / ref_cpu if hit else float("inf"))
        samples = ref["curve"][-1][1] * ref.get("batch", 12)
        ratios[f"{kind} samples"].append(hit[1] * run["batch"] / samples if hit else float("inf"))
    target = runs[refs[0]]["final_val"] if suite == "shakespeare" else runs[refs[0]]["curve"][-1][2]
    return {**report, "target": target, "ratios": ratios}


def plot(reports: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)
    for ax, (suite, report) in zip(axes[0], reports.items(), strict=True):
        for name, run in report["runs"].items():
            if run["curve"]:
                t, _, loss = zip(*run["curve"])
                ax.plot(t, loss, marker=".", lw=1, label=name)
        unit = "nats/char" if suite == "shakespeare" else "nats/token"
        ax.set(xlabel="wall seconds since launch", ylabel=f"val loss ({unit})")
        if np.isfinite(report["target"]):  # a run without its reference (--only fast) has no target
            ax.axhline(
                report["target"], color="grey", ls="--", lw=0.8, label=f"{report['reference']} final val loss"
            )
            ax.set_ylim(None, report["target"] + 1.2)
        ax.set_title(
            {
                "shakespeare": "Tiny Shakespeare (char), nanoGPT CPU recipe size",
                "wikitext": "WikiText-2 (BPE), fast recipe vs AdamW",
            }[suite],
            fontsize=9,
        )
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def seeds(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def merge(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """Several ``--json`` outputs (e.g. one per seed, run in parallel) as one report: runs and per-seed ratios
    joined."""
    out: dict[str, dict] = {}
    for part in parts:
        for suite, report in part.items():
            if suite not in out:
                out[suite] = {**report, "runs": {}}
            out[suite]["runs"].update(report["runs"])
    return out


def report_lines(suite: str, report: dict) -> list[str]:
    lines = [f"{suite}: target ({report['reference']} final val loss) {report['target']:.4f}"]
    for name, run in report["runs"].items():
        lines.append(
            f"  {name:<10} wall {run['wall']:7.1f} s  cpu {run['cpu']:7.1f} s  final val {run['curve'][-1][2]:.4f}"
            + (f"  ({run['final_val']:.4f} scored as ours)" if "final_val" in run else "")
        )
    for kind, ratios in report["ratios"].items():
        if ratios:
            median = statistics.median(ratios)
            met = "met" if median <= 0.6 else "NOT met"
            lines.append(
                f"  {kind} / {report['reference']} (to the target): median {median:.2f}x ({met}; target <= 0.6x),"
                f" per seed {[round(x, 2) for x in ratios]}"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, help="directory with nanoGPT's train.py (the shakespeare suite)")
    p.add_argument("--suites", default="shakespeare,wikitext")
    p.add_argument(
        "--data",
        type=Path,
        default=Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data")),
        help="the shared data directory (WikiText-2 under lm/wikitext-2)",
    )
    p.add_argument("--seeds", type=seeds, default=[0], help="e.g. 0,1,2 (seed = 1337 + each)")
    p.add_argument(
        "--baseline-seeds", type=seeds, default=[0], help="shakespeare: seeds of our AdamW baseline"
    )
    p.add_argument(
        "--only",
        type=lambda t: t.split(","),
        default=["nanogpt", "adamw", "fast"],
        help="the runs of this process (e.g. fast), to run sides in parallel processes and --merge",
    )
    p.add_argument("--merge", type=Path, nargs="+", help="report and plot these --json outputs together")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000, help="nanoGPT's and our AdamW baseline's")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--fast-batch", type=int, default=FAST_BATCH)
    p.add_argument("--fast-iters", type=int, default=FAST_ITERS)
    p.add_argument("--fast-eval-every", type=int, default=10)
    p.add_argument(
        "--fast-eval-from", type=int, default=0, help="score every 50 steps before this step (screening)"
    )
    p.add_argument("--muon-lr", type=float, default=FAST_OPTIM["muon"]["lr"])
    p.add_argument("--fast-adam-lr", type=float, default=FAST_OPTIM["lr"])
    p.add_argument("--ns-steps", type=int, default=FAST_OPTIM["muon"]["ns_steps"])
    p.add_argument(
        "--fast-set",
        type=override,
        nargs="*",
        default=[],
        help="the fast recipe's overrides, e.g. model.qk_norm=false optim.cooldown_fraction=0.4",
    )
    p.add_argument("--wt-vocab", type=int, default=2048)
    p.add_argument("--wt-seq", type=int, default=128)
    p.add_argument("--wt-batch", type=int, default=12)
    p.add_argument("--wt-steps", type=int, default=400)
    p.add_argument(
        "--wt-fast-fraction", type=float, default=0.5, help="the fast run's steps / the baseline's"
    )
    p.add_argument("--wt-eval-every", type=int, default=20)
    p.add_argument("--wt-val-tokens", type=int, default=32768)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "time_to_loss.png")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--reuse-nanogpt", action="store_true", help="reuse the nanoGPT runs found in --work")
    p.add_argument(
        "--work", type=Path, default=None, help="keep the runs here (default: a temporary directory)"
    )
    if sys.argv[1:2] == ["--driver"]:
        return driver(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]))
    args = p.parse_args()
    suites = args.suites.split(",")
    if "shakespeare" in suites and args.nanogpt is None and not args.merge:
        p.error("the shakespeare suite needs --nanogpt DIR (git clone https://github.com/karpathy/nanoGPT)")
    torch.set_num_threads(args.threads)
    reports = merge([json.loads(path.read_text()) for path in args.merge]) if args.merge else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for suite in [] if args.merge else suites:
            if (report := {"shakespeare": shakespeare, "wikitext": wikitext}[suite](args, work)) is not None:
                reports[suite] = report
    reports = {suite: with_ratios(suite, report) for suite, report in reports.items()}
    for suite, report in reports.items():
        print("\n".join(report_lines(suite, report)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    if reports:
        plot(reports, args.plot)
    print(f"plot: {args.plot}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
