"""``pretrain ladder``: arguments -> ``pretrain.ladder`` calls.

pretrain ladder RECIPE --out DIR [k=v ...] [--executor local|slurm|ray]   # train the cells, fit, report
pretrain ladder DIR                                                      # fit DIR's finished cells again
pretrain ladder DIR --budget FLOPS                                       # the compute-optimal model
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrain.errors import InputError
from pretrain.ladder.plan import PLAN_FILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "recipe", help="a recipe with a `ladder:` section, or a ladder directory (--budget, refit)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe (ladder.* included)")
    p.add_argument("--out", help="the ladder directory (cells under OUT/runs/, OUT/ladder.json, plots)")
    p.add_argument("--executor", choices=("local", "slurm", "ray"), default="local",
                   help="run the cells as local processes, a SLURM job array or Ray tasks")  # fmt: skip
    p.add_argument("--workers", type=int, help="cells at a time (default: one per --threads cores)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per cell (default 1)")
    p.add_argument("--partition", help="SLURM partition (--executor slurm)")
    p.add_argument("--time", help="SLURM time limit per cell (--executor slurm)")
    p.add_argument("--budget", type=float, help="FLOPs: print the compute-optimal N, D and overrides for it")
    p.add_argument(
        "--allow-failed", action="store_true", help="fit without failed cells (named in the report)"
    )


def main(args: argparse.Namespace) -> int:
    from pretrain.ladder import refit, run_ladder

    as_dir = Path(args.recipe)
    if (as_dir / PLAN_FILE).is_file():
        if args.overrides or args.out:
            raise InputError(
                f"{as_dir} is a ladder directory: give --budget FLOPS (or nothing, to refit), no overrides"
            )
        if args.budget is not None:
            return _budget(as_dir, args.budget)
        _, report = refit(as_dir, args.allow_failed)
        _summary(as_dir, report)
        return 0
    if args.out is None:
        raise InputError("pretrain ladder RECIPE needs --out DIR (where the cells, ladder.json and plots go)")
    if args.budget is not None:
        raise InputError(
            f"--budget reads a finished ladder: pretrain ladder {args.out} --budget {args.budget:g}"
        )
    for verb in ("tokenizer", "prepare"):  # cached: reused when present and up to date
        if args.run_verb([verb, args.recipe, *args.overrides]) != 0:
            return 2
    options = {k: v for k, v in (("partition", args.partition), ("time", args.time)) if v}
    if args.executor != "local":  # a `pretrain fit` process: its threads, ~2 GB resident on the CPU
        options |= {"cpus_per_task": args.threads, "mem_per_cpu_gb": max(1, 4 // args.threads)}
    _, report = run_ladder(args.recipe, args.overrides, args.out, executor=args.executor, workers=args.workers,
                              threads=args.threads, options=options, allow_failed=args.allow_failed)  # fmt: skip
    if report is None:
        print(
            f"submitted the unfinished cells of {args.out} as a SLURM job array; rerun this command once it ends"
        )
        return 0
    _summary(Path(args.out), report)
    return 0


def _summary(out: Path, report: dict) -> None:
    fit = report["fit"]
    ci = fit["intervals"]
    lines = [
        (
            f"L(N, D) = {fit['E']:.3f} + {fit['A']:.4g} / N^{fit['alpha']:.3f} + {fit['B']:.4g} / D^{fit['beta']:.3f}"
            f"  ({fit['cells']} cells; N: non-embedding parameters, D: tokens)"
        ),
        (
            f"alpha {fit['alpha']:.3f} [{ci['alpha'][0]:.3f}, {ci['alpha'][1]:.3f}], beta {fit['beta']:.3f} "
            f"[{ci['beta'][0]:.3f}, {ci['beta'][1]:.3f}] (95 % bootstrap)"
        ),
    ]
    held = report.get("held_out")
    if held:
        lines.append(
            f"held out {held['cell']}: predicted {held['predicted']:.4f}, actual {held['actual']:.4f} "
            f"({held['rel_error'] * 100:+.2f} %)"
        )
    iso = report["isoflop"]
    if "a" in iso:
        lines.append(
            f"isoFLOP: N_opt ~ C^{iso['a']:.3f} [{iso['a_interval'][0]:.3f}, {iso['a_interval'][1]:.3f}]"
        )
    for note in (iso.get("warning"), iso.get("skipped")):
        if note:
            lines.append(f"isoFLOP: {note}")
    if report["excluded"]:
        lines.append(f"left out (failed): {', '.join(report['excluded'])}")
    lines.append(f"report: {out / 'ladder.json'}; plots: {', '.join(report['plots'].values())}")
    print("\n== pretrain ladder: fitted ==\n" + "\n".join(f"  {line}" for line in lines))


def _budget(out: Path, flops: float) -> int:
    from pretrain.ladder import cell_run
    from pretrain.ladder.plan import read_plan
    from pretrain.ladder.report import optimal_for_budget, read_report, shape_text

    plan = read_plan(out)
    best = optimal_for_budget(plan, read_report(out), cell_run(plan), flops)
    lo, hi = best["N_interval"]
    dlo, dhi = best["D_interval"]
    print(
        f"compute-optimal at {flops:.3g} FLOPs ({plan.objective}):\n"
        f"  N = {best['N']:,.0f} non-embedding parameters [{lo:,.0f}, {hi:,.0f}] (95 % bootstrap)\n"
        f"  D = {best['D']:,.0f} tokens [{dlo:,.0f}, {dhi:,.0f}], {best['tokens_per_param']:.1f} tokens per parameter\n"
        f"  predicted loss {best['loss']:.4f}; shape: {shape_text(best['shape'])}\n"
        f"  overrides: {' '.join(best['overrides'])}"
    )
    return 0
