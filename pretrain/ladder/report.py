"""A finished ladder's fit, written to ``DIR/ladder.json`` with its plots, and the compute-optimal model for a
FLOP budget read back from it (``pretrain ladder DIR --budget FLOPS``)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from threadpoolctl import threadpool_limits

from pretrain.errors import InputError
from pretrain.ladder.config import LadderConfig
from pretrain.ladder.fit import (
    PARAMETERS,
    Law,
    bootstrap_laws,
    fit_law,
    interval,
    isoflop_parabola,
    power_law_exponent,
)
from pretrain.ladder.plan import FLOPS_CONVENTION, N_DEFINITION, Cell, Plan, Shape
from pretrain.ladder.run import failure, result, status
from pretrain.ladder.shapes import Family, family

LADDER_FILE = "ladder.json"


def finished(plan: Plan, allow_failed: bool = False) -> tuple[list[tuple[Cell, float]], list[str]]:
    """(cell, final loss) of every finished cell and the names of failed ones left out (``allow_failed``);
    ValueError naming the cells that keep the fit from running (one line)."""
    objectives = {yaml.safe_load(Path(c.recipe).read_text())["objective"]["name"] for c in plan.cells}
    if len(objectives) > 1:
        raise InputError(f"the cells mix objectives {sorted(objectives)}: fit one ladder per objective")
    pending = [c.name for c in plan.cells if status(c) == "pending"]
    if pending:
        raise InputError(
            f"{len(pending)} cell(s) not finished: {', '.join(pending)}; rerun `pretrain ladder` (under SLURM, "
            f"once the job array has ended) to train them"
        )
    failed = [c for c in plan.cells if status(c) == "failed"]
    if failed and not allow_failed:
        first = failure(failed[0])
        raise InputError(
            f"{len(failed)} cell(s) failed: {', '.join(c.name for c in failed)} ({failed[0].name}: {first['reason']}, "
            f"log {first['log']}); rerun `pretrain ladder` to retry them, or --allow-failed to fit without them"
        )
    return [(c, float(result(c)["loss"])) for c in plan.cells if status(c) == "done"], [
        c.name for c in failed
    ]


def _interval_of(values: list[float]) -> list[float]:
    return list(interval(values)) if values else [math.nan, math.nan]


def _optimum(law: Law, C: float, shapes: Family) -> int:
    losses = law.loss(shapes.params, C / shapes.flops_per_token)
    return int(np.nanargmin(losses)) if np.isfinite(losses).any() else 0


def compute_optimal(
    law: Law, laws: list[Law], C: float, shapes: Family, tokens_per_step: int
) -> dict[str, Any]:
    """The shape minimising the fitted loss at ``C`` FLOPs (D = C / F), with 95 % bootstrap intervals."""
    i = _optimum(law, C, shapes)
    boot = [_optimum(b, C, shapes) for b in laws]
    N, D = shapes.params, C / shapes.flops_per_token
    shape = shapes.shapes[i]
    steps = max(1, round(D[i] / tokens_per_step))
    return {
        "flops": C,
        "N": float(N[i]),
        "N_interval": _interval_of([float(N[j]) for j in boot]),
        "D": float(D[i]),
        "D_interval": _interval_of([float(D[j]) for j in boot]),
        "tokens_per_param": float(D[i] / N[i]),
        "tokens_per_param_interval": _interval_of([float(D[j] / N[j]) for j in boot]),
        "loss": float(law.loss(N[i], D[i])),
        "shape": shape.__dict__,
        "overrides": [f"model.{k}={v}" for k, v in shape.overrides().items()]
        + [f"trainer.max_steps={steps}"],
    }


def _isoflop(
    plan: Plan, cells: list[tuple[Cell, float]], shapes: Family, ladder: LadderConfig
) -> dict[str, Any]:
    """Approach 2 over the fitted cells: a parabola per budget, N_opt ~ C^a and D_opt ~ C^b (D_opt = C / F at
    N_opt, F interpolated in log-log along the ladder's shapes), intervals by resampling cells per budget."""
    if plan.budget_kind != "flops":
        return {
            "skipped": "ladder.tokens_per_param budgets share no FLOP budget; give ladder.flops for approach 2"
        }
    groups: dict[float, list[tuple[Cell, float]]] = defaultdict(list)
    for cell, loss in cells:
        groups[cell.budget].append((cell, loss))

    def log_f(n: float) -> float:
        return float(np.interp(np.log(n), np.log(shapes.params), np.log(shapes.flops_per_token)))

    def profiles(pick: dict[float, list[tuple[Cell, float]]]) -> list[Any]:
        out = []
        for C, group in sorted(pick.items()):
            if len({c.params for c, _ in group}) >= 3:
                out.append(isoflop_parabola(C, [c.params for c, _ in group], [loss for _, loss in group]))
        return out

    def exponents(parabolas: list[Any]) -> tuple[float, float] | None:
        inside = [p for p in parabolas if p.inside]
        if len(inside) < 2:
            return None
        C = [p.flops for p in inside]
        n_opt = [p.n_opt for p in inside]
        d_opt = [c / math.exp(log_f(n)) for c, n in zip(C, n_opt)]
        return power_law_exponent(C, n_opt)[0], power_law_exponent(C, d_opt)[0]

    parabolas = profiles(groups)
    budgets = [
        {"flops": p.flops, "N_opt": p.n_opt, "inside": p.inside, "sizes": [p.n_min, p.n_max],
         "coefficients": list(p.coefficients)}
        for p in parabolas
    ]  # fmt: skip
    outside = [b for b in budgets if not b["inside"]]
    body: dict[str, Any] = {"budgets": budgets}
    if outside:
        body["warning"] = (
            f"the sizes do not span {len(outside)} budget(s) ({', '.join(format(b['flops'], '.3g') for b in outside)}): "
            "the isoFLOP minimum lies outside the sizes run (or the profile is not convex); add sizes beyond it"
        )
    fitted = exponents(parabolas)
    if fitted is None:
        body["skipped"] = "fewer than 2 budgets with an isoFLOP minimum inside the sizes"
        return body
    rng = np.random.default_rng(ladder.seed)
    samples = []
    for _ in range(ladder.bootstrap):
        pick = {C: [g[i] for i in rng.integers(0, len(g), len(g))] for C, g in groups.items()}
        try:
            e = exponents(profiles(pick))
        except (ValueError, np.linalg.LinAlgError):
            continue
        if e is not None:
            samples.append(e)
    body |= {
        "a": fitted[0],
        "a_interval": _interval_of([s[0] for s in samples]),
        "b": fitted[1],
        "b_interval": _interval_of([s[1] for s in samples]),
        "bootstrap_samples": len(samples),
    }
    return body


def fit_ladder(
    plan: Plan, out: Path, ladder: LadderConfig, run: Any, allow_failed: bool = False
) -> dict[str, Any]:
    """Fit the finished ladder; write ``DIR/ladder.json`` and the plots; return the report."""
    cells, excluded = finished(plan, allow_failed)
    fitted = [(c, loss) for c, loss in cells if not c.held_out]
    N, D, L = ([c.params for c, _ in fitted], [c.tokens for c, _ in fitted], [loss for _, loss in fitted])
    with threadpool_limits(limits=1):  # BLAS threads on arrays of a dozen cells only spin (40x slower here)
        full = fit_law(N, D, L)
        laws = bootstrap_laws(N, D, L, full, samples=ladder.bootstrap, seed=ladder.seed)
        shapes = family(plan, run)
        report: dict[str, Any] = {
            "objective": plan.objective,
            "arch": plan.arch,
            "n_definition": N_DEFINITION,
            "flops_convention": FLOPS_CONVENTION,
            "budget_kind": plan.budget_kind,
            "excluded": excluded,
            "cells": [
                {
                    "name": c.name,
                    "N": c.params,
                    "D": c.tokens,
                    "C": c.flops,
                    "steps": c.steps,
                    "tokens_per_param": c.tokens_per_param,
                    "loss": loss,
                    "held_out": c.held_out,
                    "predicted": float(full.law.loss(c.params, c.tokens)),
                }
                for c, loss in cells
            ],
        }
        law = full.law
        a = [b.beta / (b.alpha + b.beta) for b in laws]
        report["fit"] = {
            **law.as_dict(),
            "intervals": {k: _interval_of([getattr(b, k) for b in laws]) for k in PARAMETERS},
            "a": law.beta / (law.alpha + law.beta),  # N_opt ~ C^a (C = 6 N D)
            "a_interval": _interval_of(a),
            "b": law.alpha / (law.alpha + law.beta),
            "b_interval": _interval_of([1 - x for x in a]),
            "cells": len(fitted),
            "huber_objective": full.objective,
            "bootstrap": {"samples": len(laws), "laws": [[getattr(b, k) for k in PARAMETERS] for b in laws]},
        }
        held = [(c, loss) for c, loss in cells if c.held_out]
        if held:
            c, actual = held[0]
            predicted = float(law.loss(c.params, c.tokens))
            report["held_out"] = {
                "cell": c.name, "N": c.params, "D": c.tokens, "C": c.flops, "predicted": predicted,
                "interval": _interval_of([float(b.loss(c.params, c.tokens)) for b in laws]),
                "actual": actual, "rel_error": (predicted - actual) / actual,
            }  # fmt: skip
        report["isoflop"] = _isoflop(plan, fitted, shapes, ladder)
        budgets = sorted({c.flops if plan.budget_kind != "flops" else c.budget for c in plan.cells})
        report["compute_optimal"] = [
            compute_optimal(law, laws, C, shapes, plan.tokens_per_step) for C in budgets
        ]
    from pretrain.io import atomic_write_text
    from pretrain.ladder.plots import plot_ladder

    report["plots"] = plot_ladder(report, shapes, out)
    atomic_write_text(out / LADDER_FILE, json.dumps(report, indent=1))
    return report


def read_report(out: Path) -> dict[str, Any]:
    path = out / LADDER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{out} has no {LADDER_FILE} yet: run `pretrain ladder RECIPE --out {out}` to the end"
        )
    return json.loads(path.read_text())


def optimal_for_budget(plan: Plan, report: dict[str, Any], run: Any, C: float) -> dict[str, Any]:
    """The compute-optimal shape and tokens at ``C`` FLOPs under the fit in ``report``."""
    if not C > 0:
        raise InputError(f"--budget must be > 0 FLOPs, got {C}")
    law = Law(**{k: report["fit"][k] for k in PARAMETERS})
    laws = [Law(*row) for row in report["fit"]["bootstrap"]["laws"]]
    with threadpool_limits(limits=1):
        shapes = family(plan, run)
        best = compute_optimal(law, laws, C, shapes, plan.tokens_per_step)
    for edge, where in ((shapes.shapes[0], "smallest"), (shapes.shapes[-1], "largest")):
        if best["shape"] == edge.__dict__:
            raise InputError(
                f"the fit's compute-optimal model at {C:.3g} FLOPs is the {where} shape searched (d_model "
                f"{edge.d_model}): the budget is out of this ladder's reach; give a budget nearer its cells' "
                f"({plan.cells[0].flops:.3g} to {max(c.flops for c in plan.cells):.3g} FLOPs)"
            )
    return best


def shape_text(shape: dict[str, Any]) -> str:
    s = Shape(**shape)
    return (
        f"d_model {s.d_model}, {s.n_layer} layers"
        + (f" + {s.n_decoder_layer} decoder layers" if s.n_decoder_layer is not None else "")
        + f", {s.n_head} heads of {s.head_dim}, d_ff {s.d_ff}"
    )


def fit_text(out: Path, report: dict[str, Any]) -> str:
    """What ``pretrain ladder`` prints about a fitted ladder ``report`` of directory ``out``."""
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
    return "\n== pretrain ladder: fitted ==\n" + "\n".join(f"  {line}" for line in lines)
