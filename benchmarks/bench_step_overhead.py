"""What ``pretrain fit`` costs beyond a plain PyTorch loop: start-up to the first step, and time per step.

Both measured in the same run against peers on the same machine, CPU time (user + system, the stable figure on a
shared machine) and wall time, interleaved A/B over ``--rounds``, medians reported:

- start-up: a whole process that trains 1 step and then evaluates 20 batches -- ``pretrain fit`` (the tiny GPT of
  nanoGPT's CPU recipe size: 4 layers, 4 heads, d=128, context 64, batch 12) vs a plain script (torch, the same
  ``Transformer``, the same prepared shards, the same step and evaluation) and, with ``--nanogpt DIR`` (a checkout
  of karpathy/nanoGPT with ``data/shakespeare_char`` prepared), nanoGPT's ``train.py`` on its documented CPU
  recipe with ``--max_iters=0`` (one evaluation of 2 x 20 batches, one step). Target: <= 1.5x nanoGPT.
- per step: ``Trainer.fit`` with everything ``pretrain fit`` runs (non-finite guard, hang watchdog, throughput
  monitor, checkpoint callbacks, CSV logging every 10 steps, progress bar) vs the plain loop (forward, loss,
  backward, clip, fused AdamW, schedule) over the same model and batches. Target: <= 5 %. Each loop runs in a
  fresh process (one in the heap another left varies by a few ms with that heap's state), and the loop that runs
  first in a round alternates (ABBA). Both run with the host-memory reuse ``pretrain fit`` sets up
  (``trainer.reuse_host_memory``, process-wide: ``pretrain/training/host_memory.py``); ``--glibc-defaults`` runs
  both with glibc's malloc defaults instead.
  ``--ablate`` times ``pretrain fit`` without one part at a time (progress bar, hang watchdog, non-finite guard,
  logging, clipping, the GC schedule) and Lightning alone (the plain loop's step as a minimal LightningModule under
  a bare ``lightning.Trainer``: the floor of Lightning's loop), in Lightning's gradient order and in ``pretrain
  fit``'s (gradients freed right after the update); ``--profile`` adds Lightning's ``SimpleProfiler``: mean ms per
  step of the costliest hooks.
- host memory (``--only memory``): both loops in fresh processes, glibc's malloc defaults vs reused host memory
  alternating over ``--rounds``: CPU ms and minor page faults per step.

    python benchmarks/bench_step_overhead.py [--rounds 3] [--steps 60] [--nanogpt /path/to/nanoGPT]
    python benchmarks/bench_step_overhead.py --only memory --rounds 4 --steps 100
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_timing import RECIPE, REPO_ROOT, corpus_overrides, prepare_corpus

ABLATIONS = {  # pretrain fit with everything, and without one part (overrides)
    "everything": (),
    "no progress bar": ("trainer.progress_bar=false",),
    "no hang watchdog": ("guards.hang.enabled=false",),
    "no non-finite guard": ("guards.nonfinite.enabled=false",),
    "no CSV logging": ("logger.csv=false", "trainer.log_every_n_steps=100000"),
    "no gradient clipping": ("trainer.gradient_clip_val=null",),
    "Python's automatic GC": ("trainer.gc_every_n_steps=0",),
}
NANOGPT_CPU = [  # nanoGPT's README, "I only have a macbook" (CPU), evaluated once and stepped once
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=0",
    "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip


def overrides(work: Path, tag: str, steps: int, progress_bar: bool = True) -> list[str]:
    """The tiny GPT at nanoGPT's CPU-recipe size; validation of 20 batches after the last step only."""
    return [
        *corpus_overrides(work, tag),
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=20",
        f"checkpoint.every_n_steps={steps}",
        f"trainer.progress_bar={str(progress_bar).lower()}",
        "model.dropout=0.0",
        "data.micro_batch_size=12",
        "data.seq_len=64",
    ]


def child_clock(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of running ``command`` to completion."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def plain_startup(work: Path) -> None:
    """The plain peer's process: build the model and data as a hand-written script would, 1 step, 20 eval batches."""
    import torch

    from pretrain import config
    from pretrain.datamodules.tokenizer import load_tokenizer
    from pretrain.models.transformer import Transformer
    from pretrain.optim import build_optimizer
    from pretrain.training.setup import build_data, build_objective

    run, _ = config.load(RECIPE, overrides(work, "plain-startup", 1))
    tokenizer = load_tokenizer(run.tokenizer.path)
    objective = build_objective(run, tokenizer)
    data = build_data(run, objective, tokenizer)
    data.setup("fit")
    model = Transformer(run.model)
    optimizer = build_optimizer(model, run.optim)
    batch = next(iter(data.train_dataloader()))
    loss_sum, n = objective.loss(model(batch["input_ids"]).logits, batch["labels"])
    (loss_sum / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.eval()
    with torch.no_grad():
        for i, val in enumerate(data.val_dataloader()):
            if i == 20:
                break
            objective.loss(model(val["input_ids"]).logits, val["labels"])


def startup(work: Path, args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    runs = {
        "pretrain fit": [sys.executable, "-m", "pretrain", "fit", str(RECIPE), *overrides(work, "fit", 1)],
        "plain script": [sys.executable, __file__, "--plain-startup", str(work)],
    }
    if args.nanogpt:
        out = f"--out_dir={work / 'nanogpt-out'}"
        runs["nanoGPT train.py"] = ["sh", "-c", f"cd {args.nanogpt} && exec {sys.executable} train.py "
                                    + " ".join([*NANOGPT_CPU, out])]  # fmt: skip
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, command in runs.items():
            times[name].append(child_clock(command, env))
        print(
            f"round {r}: "
            + ", ".join(f"{n} {t[-1][1]:.2f} CPU-s ({t[-1][0]:.2f} s)" for n, t in times.items())
        )
    print(
        f"\nstart-up to 1 step + 20 evaluation batches, {args.rounds} rounds (medians), load {os.getloadavg()[0]:.1f}"
    )
    med = {n: tuple(statistics.median(x[i] for x in t) for i in (0, 1)) for n, t in times.items()}
    for name, (wall, cpu) in med.items():
        print(f"  {name:>17}: {cpu:6.2f} CPU-s {wall:6.2f} s wall")
    for peer in [p for p in ("nanoGPT train.py", "plain script") if p in med]:
        cpu_ratio, wall_ratio = (med["pretrain fit"][i] / med[peer][i] for i in (1, 0))
        print(f"  pretrain fit / {peer}: {cpu_ratio:.2f}x CPU, {wall_ratio:.2f}x wall")


# ----------------------------------------------------------------------------------------------- per step
LOOPS = (
    "plain",
    "fit",
    "lightning",
    "lightning-freed",
)  # what --step-child runs (lightning: Lightning alone)


def loop_rate(work: Path, args: argparse.Namespace, kind: str, ablation: str = "everything", profiler=None):
    """(wall, CPU) seconds per step of one loop: the plain loop, ``pretrain fit`` (without ``ablation``'s part)
    or Lightning alone (in Lightning's gradient order, or ``-freed`` in pretrain fit's)."""
    from step_timing import fit_clocks, lightning_clocks, plain_clocks, rate

    tag = f"{kind}-{ablation}".replace(" ", "_")
    base = overrides(work, tag, args.steps)
    memory = f"trainer.reuse_host_memory={str(not args.glibc_defaults).lower()}"
    if kind == "plain":
        times = plain_clocks(base)
    elif kind.startswith("lightning"):
        times = lightning_clocks(base, free_gradients=kind == "lightning-freed")
    else:
        times = fit_clocks([*base, memory, *ABLATIONS[ablation]], profiler)
    return rate(times[: args.steps])


def set_up_loop(args: argparse.Namespace) -> None:
    """What every timed loop's process gets: the thread count and the host-memory reuse pretrain fit sets up."""
    import torch

    from pretrain.training.host_memory import reuse_freed_memory

    torch.set_num_threads(args.threads)
    if not args.glibc_defaults:
        reuse_freed_memory()


def step_child(work: Path, args: argparse.Namespace) -> None:
    """One loop in this fresh process."""
    set_up_loop(args)
    print("RESULT", *loop_rate(work, args, args.kind, args.ablation))


def fresh_rate(work: Path, args: argparse.Namespace, kind: str, ablation: str = "everything"):
    """``loop_rate`` in a fresh process: no loop runs in the heap another one left."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, __file__, "--step-child", str(work), "--kind", kind, "--ablation", ablation,
               "--steps", str(args.steps), "--threads", str(args.threads),
               *(["--glibc-defaults"] if args.glibc_defaults else [])]  # fmt: skip
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    wall, cpu = (float(v) for v in out.split("RESULT")[-1].split())
    return wall, cpu


def per_step(work: Path, args: argparse.Namespace) -> None:
    from lightning.pytorch.profilers import SimpleProfiler

    results: dict[str, list[tuple[float, float]]] = {"plain": [], "fit": []}
    for r in range(args.rounds):  # ABBA: the loop that runs first in a round alternates
        for name in ("plain", "fit") if r % 2 == 0 else ("fit", "plain"):
            results[name].append(fresh_rate(work, args, name))
        (pw, pc), (lw, lc) = results["plain"][-1], results["fit"][-1]
        print(
            f"round {r}: plain {1e3 * pc:.1f} CPU-ms/step ({1e3 * pw:.1f} ms), fit {1e3 * lc:.1f} ({1e3 * lw:.1f})"
            f": {lc / pc:.3f}x"
        )
    malloc = (
        "glibc's malloc defaults" if args.glibc_defaults else "host memory reused (trainer.reuse_host_memory)"
    )
    print(f"\nper step, {args.steps} steps x {args.rounds} rounds (medians), each loop in a fresh process, "
          f"{malloc}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    for i, clock in ((1, "CPU clock"), (0, "wall clock")):
        p, f = (statistics.median(x[i] for x in results[k]) for k in ("plain", "fit"))
        per_round = statistics.median(fit[i] / loop[i] for fit, loop in zip(results["fit"], results["plain"]))
        print(f"  {clock:>10}: plain loop {1e3 * p:.2f} ms/step, pretrain fit {1e3 * f:.2f} ms/step: "
              f"{f / p:.3f}x (overhead {100 * (f / p - 1):+.1f} %; target <= 5 %; median of the rounds' "
              f"ratios {per_round:.3f}x)")  # fmt: skip
    if args.ablate:
        print(
            f"\nwhat costs what: each loop in a fresh process, CPU ms per step ({args.rounds} rounds, medians)"
        )
        runs = [("lightning", "everything"), ("lightning-freed", "everything")]
        runs += [("fit", name) for name in ABLATIONS]
        cost: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for _ in range(args.rounds):
            for (kind, ablation), values in cost.items():
                values.append(1e3 * fresh_rate(work, args, kind, ablation)[1])
        ms = {run: statistics.median(values) for run, values in cost.items()}
        full = ms["fit", "everything"]
        print(f"  {'plain loop':>28}: {1e3 * statistics.median(x[1] for x in results['plain']):6.2f}")
        print(f"  {'Lightning alone':>28}: {ms['lightning', 'everything']:6.2f}  (the plain step as a "
              "LightningModule, no callbacks, logger or checkpoints; Lightning's gradient order)")  # fmt: skip
        print(f"  {'+ gradients freed after step':>28}: {ms['lightning-freed', 'everything']:6.2f}  (the same in "
              "pretrain fit's order: pretrain.training.step.FreeGradientsAfterStep)")  # fmt: skip
        for name in ABLATIONS:
            note = "" if name == "everything" else f"  (the part costs {full - ms['fit', name]:+.2f})"
            print(f"  {name:>28}: {ms['fit', name]:6.2f}{note}")
    if args.profile:
        profiler = SimpleProfiler()
        set_up_loop(args)
        loop_rate(work, args, "fit", profiler=profiler)
        steps = args.steps
        print(f"\nhooks of pretrain fit (Lightning SimpleProfiler), mean ms per step over {steps} steps:")
        costs = {
            k: 1e3 * sum(v) / steps for k, v in profiler.recorded_durations.items() if "validation" not in k
        }
        for name, ms_ in sorted(costs.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {ms_:8.3f}  {name}")


# ----------------------------------------------------------------------------------------------- host memory
def memory_child(work: Path, args: argparse.Namespace) -> None:
    """One process: the plain loop then ``pretrain fit``; prints CPU-ms and page faults per step of each."""
    import torch
    from step_timing import faults_per_step, fit_clocks, plain_clocks, rate

    from pretrain.training.host_memory import reuse_freed_memory

    torch.set_num_threads(args.threads)
    if not args.glibc_defaults:
        reuse_freed_memory()
    memory = [f"trainer.reuse_host_memory={str(not args.glibc_defaults).lower()}"]
    plain = plain_clocks(overrides(work, "memory-plain", args.steps))
    fit = fit_clocks([*overrides(work, "memory-fit", args.steps), *memory])[: args.steps]
    print("RESULT", *(f"{v:.4f}" for t in (plain, fit) for v in (1e3 * rate(t)[1], faults_per_step(t))))


def host_memory(work: Path, args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    modes = {"glibc defaults": ["--glibc-defaults"], "host memory reused": []}
    results: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode, flags in modes.items():
            command = [
                sys.executable,
                __file__,
                "--memory-child",
                str(work),
                "--steps",
                str(args.steps),
                *flags,
            ]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            results[mode].append([float(v) for v in out.split("RESULT")[-1].split()])
        print(f"round {r}: " + ", ".join(f"{m}: plain {v[-1][0]:.1f} CPU-ms/step, fit {v[-1][2]:.1f}"
                                         for m, v in results.items()))  # fmt: skip
    print(
        f"\nhost memory, {args.steps} steps x {args.rounds} rounds (medians), load {os.getloadavg()[0]:.1f}"
    )
    for mode, rows in results.items():
        plain_ms, plain_faults, fit_ms, fit_faults = (
            statistics.median(row[i] for row in rows) for i in range(4)
        )
        print(f"  {mode:>18}: plain loop {plain_ms:6.2f} CPU-ms/step {plain_faults:6.0f} faults/step, "
              f"pretrain fit {fit_ms:6.2f} CPU-ms/step {fit_faults:6.0f} faults/step")  # fmt: skip
    for i, name in ((0, "plain loop"), (2, "pretrain fit")):
        gains = [d[i] - r[i] for d, r in zip(results["glibc defaults"], results["host memory reused"])]
        print(f"  {name}: reused memory saves {statistics.median(gains):.2f} CPU-ms/step "
              f"(per round {min(gains):.2f} to {max(gains):.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout with data/shakespeare_char prepared")
    parser.add_argument("--only", choices=["startup", "step", "memory"], help="one of the measurements")
    parser.add_argument("--profile", action="store_true", help="per-hook costs of pretrain fit's step")
    parser.add_argument("--ablate", action="store_true", help="pretrain fit without one part at a time")
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="both with glibc's malloc defaults (no host-memory reuse)",
    )
    parser.add_argument("--plain-startup", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--step-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=LOOPS, default="fit", help=argparse.SUPPRESS)
    parser.add_argument("--ablation", choices=list(ABLATIONS), default="everything", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_startup:
        return plain_startup(args.plain_startup)
    if args.memory_child:
        return memory_child(args.memory_child, args)
    if args.step_child:
        return step_child(args.step_child, args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_corpus(work)
        if args.only in (None, "startup"):
            startup(work, args)
        if args.only in (None, "step"):
            per_step(work, args)
        if args.only == "memory":
            host_memory(work, args)


if __name__ == "__main__":
    main()
