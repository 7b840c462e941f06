"""Context extension with YaRN: held-out perplexity at 1,024 tokens of a tiny decoder trained at 128 tokens, before
and after extension, against plain continued training at 1,024 tokens without scaling for the same steps.

Runs the long-context recipe (docs/long-context.md) in the current directory, each step a fresh ``pretrain``
process: tokenizer and prepare (WikiText-2 valid.txt articles), ``recipes/long-context-base.yaml`` (128 tokens),
then ``recipes/long-context-yarn.yaml`` twice from its checkpoint (YaRN factor 8; and ``model.rope_scaling=null``).
Existing runs are reused (``--fresh`` trains again). Then every model reads WikiText-2 test.txt (held out: no run
trained on it) cut into windows of 1,024 tokens; printed: perplexity of predicting every token, tokens 1-127
(within the context the base model was trained at) and over tokens 128-1,023 (beyond it), and the load average.

    python benchmarks/bench_long_context.py [--max-windows 64] [--fresh]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from pretrain.checkpoint import load_model
from pretrain.datamodules.tokenizer import resolve_eos
from pretrain.evaluation.context_length import position_losses, text_tokens
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
BASE, YARN = RECIPES / "long-context-base.yaml", RECIPES / "long-context-yarn.yaml"
CONTEXT, TRAINED = 1024, 128
QUIET = ["trainer.progress_bar=false", "logger.wandb.enabled=false"]


def pretrain(*args: str) -> tuple[float, float]:
    """Run ``pretrain *args`` in a fresh process; its (wall, CPU) seconds (CPU: user + system of all its threads,
    steadier than wall on a shared machine)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "pretrain", *args], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.perf_counter() - start, cpu


def train(fresh: bool) -> dict[str, tuple[float, float]]:
    """The three runs (reused when their last.ckpt exists, unless ``fresh``); (wall, CPU) seconds of each step."""
    runs = {
        "long-context-base": ("fit", str(BASE), *QUIET),
        "long-context-yarn": ("fit", str(YARN), *QUIET),
        "long-context-plain": (
            "fit",
            str(YARN),
            "name=long-context-plain",
            "model.rope_scaling=null",
            *QUIET,
        ),
    }
    seconds = {"tokenizer": pretrain("tokenizer", str(BASE)), "prepare": pretrain("prepare", str(BASE))}
    for name, args in runs.items():
        if fresh and Path("runs", name).exists():
            shutil.rmtree(Path("runs", name))
        if not Path("runs", name, "checkpoints", "last.ckpt").is_file():
            seconds[name] = pretrain(*args)
    return seconds


def with_config(model: Transformer, **changes) -> Transformer:
    """The same weights under another config (max_seq_len, rope_scaling: no weight depends on them)."""
    other = Transformer(dataclasses.replace(model.config, **changes))
    other.load_state_dict(model.state_dict())
    return other.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-windows", type=int, default=64, help="held-out windows of 1,024 tokens read")
    parser.add_argument("--fresh", action="store_true", help="train the three runs again")
    parser.add_argument("--data-root", default=os.environ.get("PRETRAIN_SHARED_DATA", "../shared/data"))
    args = parser.parse_args()
    seconds = train(args.fresh)
    base, info, tokenizer = load_model(Path("runs/long-context-base/checkpoints/last.ckpt"))
    yarn, _, _ = load_model(Path("runs/long-context-yarn/checkpoints/last.ckpt"))
    plain, _, _ = load_model(Path("runs/long-context-plain/checkpoints/last.ckpt"))
    scaling = {"type": "yarn", "factor": CONTEXT / TRAINED, "original_max_seq_len": TRAINED}
    models = {
        "base (trained at 128), no scaling": with_config(base, max_seq_len=CONTEXT),
        "base + YaRN x8 at inference only": with_config(
            base,
            max_seq_len=CONTEXT,
            rope_scaling=ModelConfig(position="rope", rope_scaling=scaling).rope_scaling,
        ),
        "base + YaRN x8, extended at 1,024": yarn,
        "base, continued at 1,024 without scaling": plain,
    }
    _, eos = resolve_eos(tokenizer, info["config"]["tokenizer"]["special_tokens"].get("eos"))
    tokens = text_tokens(Path(args.data_root) / "lm/wikitext-2/test.txt", tokenizer, eos)[
        : args.max_windows * CONTEXT
    ]
    steps = {n: load_model(Path(f"runs/{n}/checkpoints/last.ckpt"))[1]["config"]["trainer"]["max_steps"] for n in
             ("long-context-base", "long-context-yarn")}  # fmt: skip
    print(f"\nheld-out: WikiText-2 test.txt, {len(tokens) // CONTEXT} windows of {CONTEXT} tokens; base trained "
          f"{steps['long-context-base']} steps at {TRAINED} tokens, extensions {steps['long-context-yarn']} steps at "
          f"{CONTEXT}")  # fmt: skip
    print("| model | ppl, tokens 1-1,023 | ppl, tokens 1-127 | ppl, tokens 128-1,023 |")
    print("|---|---|---|---|")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    start, cpu = time.perf_counter(), time.process_time()
    for name, model in models.items():
        losses = position_losses(model, tokens, CONTEXT, batch_size=4)  # (1023,): predicting position i + 1
        near, far = losses[: TRAINED - 1], losses[TRAINED - 1 :]
        ppl = [math.exp(x.mean().item()) for x in (losses, near, far)]
        print(f"| {name} | {ppl[0]:.1f} | {ppl[1]:.1f} | {ppl[2]:.1f} |")
    seconds["evaluation"] = (time.perf_counter() - start, time.process_time() - cpu)
    timed = ", ".join(f"{k} {wall:.0f} / {cpu:.0f}" for k, (wall, cpu) in seconds.items())
    print(f"\nwall / CPU seconds: {timed}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
