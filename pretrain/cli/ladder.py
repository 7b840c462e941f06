"""``pretrain ladder``: arguments -> ``pretrain.ladder`` calls.

pretrain ladder RECIPE --out DIR [k=v ...] [--executor local|slurm|ray]   # train the cells, fit, report
pretrain ladder DIR                                                      # fit DIR's finished cells again
pretrain ladder DIR --budget FLOPS                                       # the compute-optimal model
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pretrain.errors import InputError
from pretrain.ladder.plan import PLAN_FILE, load_ladder, plan_ladder


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
    from pretrain.ladder import budget_text, refit, run_ladder
    from pretrain.ladder.report import fit_text

    as_dir = Path(args.recipe)
    if (as_dir / PLAN_FILE).is_file():
        if args.overrides or args.out:
            raise InputError(
                f"{as_dir} is a ladder directory: give --budget FLOPS (or nothing, to refit), no overrides"
            )
        if args.budget is not None:
            print(budget_text(as_dir, args.budget))
            return 0
        _, refitted = refit(as_dir, args.allow_failed)
        print(fit_text(as_dir, refitted))
        return 0
    if args.budget is not None and args.out is not None:
        raise InputError(
            f"--budget reads a finished ladder: pretrain ladder {args.out} --budget {args.budget:g}"
        )
    if args.budget is not None:
        raise InputError(
            f"--budget reads a finished ladder directory; {as_dir} is not one (no {as_dir / PLAN_FILE}): train "
            "the ladder first with pretrain ladder RECIPE --out DIR"
        )
    if args.out is None:
        raise InputError("pretrain ladder RECIPE needs --out DIR (where the cells, ladder.json and plots go)")
    # its `ladder:` section checked before a tokenizer or corpus is made, and the cells too (their steps) where
    # no tokenizer is needed for them (an encoder-decoder's decoder length comes from its objective's tokens)
    if load_ladder(args.recipe, args.overrides)[2].model.arch != "encoder-decoder":
        plan_ladder(args.recipe, args.overrides, args.out)
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
    print(fit_text(Path(args.out), report))
    return 0
