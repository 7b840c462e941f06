"""``torch.compile`` on the CPU (inductor + the system C++ compiler): compile time and steady-state speed-up.

* Training: ``pretrain fit`` (the end-to-end benchmark's ``pretrain`` contender, ``bench_end_to_end.py``)
  with ``trainer.compile=false`` and ``=true``, each in its own process: median CPU ms of a training step
  after warm-up, and the compile cost = loop CPU time minus steps x steady step time, eager's excess
  subtracted (it includes the recompilation for validation's no-grad graph); inductor's on-disk caches start
  empty unless ``--warm-cache`` (a rerun then costs seconds).
* Generation: ``pretrain.models.generation.generate`` (greedy, ``--new-tokens``) on the same GPT shape, batch 1
  and 8, eager vs ``model.compile(dynamic=True)`` (the cache grows every step: one dynamic graph instead of a
  recompile per length): the first call's CPU time (compile included) and the steady tokens/s of later calls.

Timing uses the CPU clock of the process and its finished children (the development machine is shared);
inductor compiles in-process (``TORCHINDUCTOR_COMPILE_THREADS=1``) so the C++ compiler runs are its children
and count. It pays when the run is longer than
compile time / (1 - 1 / speed-up) of eager steps.

    python benchmarks/bench_compile.py [--steps 120] [--threads 1] [--new-tokens 64] [--skip-training]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile in-process: compiler runs are children
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_end_to_end as e2e


def training(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.warm_cache:  # a cold compile: inductor's FX graph / autograd caches start empty
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
        e2e.prepare_data(work)
        eager = e2e.child("pretrain", work, args)
        compiled = e2e.child("pretrain_compiled", work, args)
    if not (eager and compiled):
        print("training: a run failed (see above)")
        return
    overhead = {
        name: r["loop_cpu_s"] - r["steps"] * r["step_ms"] / 1000
        for name, r in (("e", eager), ("c", compiled))
    }
    print(
        f"training ({args.steps} steps, batch {args.batch} x {args.seq_len}, L={args.layers} d={args.d_model}, "
        f"{args.threads} thread(s), CPU clock)"
    )
    print(f"  eager    step {eager['step_ms']:7.1f} ms   final val loss {eager['val_loss']:.4f}")
    print(f"  compiled step {compiled['step_ms']:7.1f} ms   final val loss {compiled['val_loss']:.4f}")
    speedup = eager["step_ms"] / compiled["step_ms"]
    compile_s = overhead["c"] - overhead["e"]
    print(f"  steady-state speed-up {speedup:.2f}x; compile time {compile_s:.1f} CPU-s", end="")
    if speedup > 1:
        saved_ms = eager["step_ms"] - compiled["step_ms"]
        print(f"; pays after {compile_s * 1000 / saved_ms:.0f} steps")
    else:
        print("; never pays at this size")


def generation(args: argparse.Namespace) -> None:
    from pretrain.models.config import ModelConfig
    from pretrain.models.generation import generate
    from pretrain.models.transformer import Transformer

    torch.manual_seed(0)
    config = ModelConfig(
        arch="decoder",
        vocab_size=e2e.VOCAB,
        d_model=args.d_model,
        n_layer=args.layers,
        n_head=e2e.HEADS,
        d_ff=4 * args.d_model,
        max_seq_len=args.seq_len + args.new_tokens,
        position="learned",
        activation="gelu_tanh",
        init="gpt2",
    )
    eager = Transformer(config).eval()
    compiled = Transformer(config).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(dynamic=True)
    print(f"generation (greedy, prompt 16, {args.new_tokens} new tokens, CPU clock)")
    for batch in (1, 8):
        prompt = torch.randint(0, e2e.VOCAB, (batch, 16), generator=torch.Generator().manual_seed(batch))
        results = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            times, outs = [], []
            for _ in range(4):
                t = e2e.cpu()
                outs.append(generate(model, prompt, args.new_tokens, greedy=True))
                times.append(e2e.cpu() - t)
            results[name] = (times[0], statistics.median(times[1:]), outs[-1])
        (_, e_steady, e_out), (c_first, c_steady, c_out) = results["eager"], results["compiled"]
        tokens = batch * args.new_tokens
        print(
            f"  batch {batch}: eager {tokens / e_steady:7.0f} tokens/s, compiled {tokens / c_steady:7.0f} "
            f"tokens/s ({e_steady / c_steady:.2f}x); first compiled call {c_first:.1f} CPU-s; "
            f"same tokens: {bool(torch.equal(e_out, c_out))}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    e2e.add_run_arguments(parser, steps=120)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument(
        "--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: cold)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_training:
        training(args)
    if not args.skip_generation:
        generation(args)


if __name__ == "__main__":
    main()
