"""Scaling-law ladders (``pretrain ladder``): train a grid of model sizes x token budgets as ordinary
``pretrain fit`` runs, fit L(N, D) = E + A / N^alpha + B / D^beta to their final validation losses (Chinchilla's
approaches 3 and 2), check it on a held-out cell, and read off the compute-optimal model for a FLOP budget.

``config`` (the recipe's ``ladder:`` section), ``plan`` (the cells and their recipes), ``run`` (executors),
``fit`` (the estimators), ``shapes`` (what the fit may recommend), ``report`` (``ladder.json``), ``plots``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pretrain.ladder.plan import Plan, load_ladder, plan_ladder, read_plan, write_plan
from pretrain.ladder.run import run_cells


def cell_run(plan: Plan) -> Any:
    """A cell's complete recipe as a validated run (the model family's other settings)."""
    from pretrain import config

    return config.load(plan.cells[0].recipe)[0]


def run_ladder(
    recipe: str,
    overrides: list[str],
    out: str | Path,
    *,
    executor: Literal["local", "slurm", "ray"] = "local",
    workers: int | None = None,
    threads: int = 1,
    options: dict[str, Any] | None = None,
    allow_failed: bool = False,
) -> tuple[Plan, dict[str, Any] | None]:
    """Plan the ladder, train what is not finished, fit it: (plan, report; None while SLURM runs cells)."""
    from pretrain.ladder.report import fit_ladder

    out = Path(out).expanduser().resolve()
    plan = plan_ladder(recipe, overrides, out)
    write_plan(plan, recipe, overrides)
    started = run_cells(plan, out, executor=executor, workers=workers, threads=threads, options=options)
    if executor == "slurm" and started:
        return plan, None
    ladder, _, _ = load_ladder(recipe, overrides)
    return plan, fit_ladder(plan, out, ladder, cell_run(plan), allow_failed)


def refit(out: str | Path, allow_failed: bool = False) -> tuple[Plan, dict[str, Any]]:
    """Fit a ladder directory's finished cells again (e.g. once a SLURM array has ended)."""
    from pretrain.ladder.config import ladder_config
    from pretrain.ladder.report import fit_ladder

    out = Path(out).expanduser().resolve()
    plan = read_plan(out)
    return plan, fit_ladder(plan, out, ladder_config(plan.ladder), cell_run(plan), allow_failed)


def budget_text(out: str | Path, flops: float) -> str:
    """The compute-optimal model at ``flops`` FLOPs under the fit of ladder directory ``out``, as
    ``pretrain ladder DIR --budget FLOPS`` prints it."""
    from pretrain.ladder.report import optimal_for_budget, read_report, shape_text

    out = Path(out)
    plan = read_plan(out)
    best = optimal_for_budget(plan, read_report(out), cell_run(plan), flops)
    lo, hi = best["N_interval"]
    dlo, dhi = best["D_interval"]
    return (
        f"compute-optimal at {flops:.3g} FLOPs ({plan.objective}):\n"
        f"  N = {best['N']:,.0f} non-embedding parameters [{lo:,.0f}, {hi:,.0f}] (95 % bootstrap)\n"
        f"  D = {best['D']:,.0f} tokens [{dlo:,.0f}, {dhi:,.0f}], {best['tokens_per_param']:.1f} tokens per parameter\n"
        f"  predicted loss {best['loss']:.4f}; shape: {shape_text(best['shape'])}\n"
        f"  overrides: {' '.join(best['overrides'])}"
    )


__all__ = ["Plan", "budget_text", "plan_ladder", "read_plan", "refit", "run_ladder"]
