"""Fitting a scaling law to a ladder's final losses: Chinchilla's approaches 3 and 2 (Hoffmann et al. 2022).

Approach 3 (parametric fit, appendix D.2)::

    L(N, D) = E + A / N^alpha + B / D^beta

in the log-space parameters x = (a, b, e, alpha, beta) with A = exp(a), B = exp(b), E = exp(e): minimise

    sum_i Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),   delta = 1e-3

with L-BFGS from every point of a grid of starts (alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
a, b in {0, 5, ..., 25}: the paper's grid, also Besiroglu et al. 2024's replication) and keep the best. The
objective is divided by delta (same minimiser) so that L-BFGS's gradient tolerance is not reached on the tiny
gradients of a delta of 1e-3. 95 % intervals: the same fit on cells resampled with replacement (bootstrap),
each started from the full-data optimum and the best grid starts.

Approach 2 (isoFLOP profiles, section 3.2): at each FLOP budget a parabola of L in log N; its vertex is
N_opt(C); N_opt proportional to C^a by least squares in log-log (and D_opt likewise).

Compute-optimal allocation under the fit: minimise L(N, C / F(N)) over the model shapes one can build, F the
training FLOPs per token of a shape (``pretrain.ladder.plan``); with F = 6 N this is the paper's closed form
N_opt = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta)) (:func:`closed_form_optimum`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from pretrain.errors import InputError

HUBER_DELTA = 1e-3
GRID = {
    "a": np.arange(0.0, 30.0, 5.0),
    "b": np.arange(0.0, 30.0, 5.0),
    "e": np.arange(-1.0, 1.5, 0.5),
    "alpha": np.arange(0.0, 2.5, 0.5),
    "beta": np.arange(0.0, 2.5, 0.5),
}
PARAMETERS = ("E", "A", "alpha", "B", "beta")


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, N: np.ndarray | float, D: np.ndarray | float) -> np.ndarray:
        # a degenerate bootstrap fit gives inf / NaN (N^alpha past float range either way), not noise
        with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
            return self.E + self.A / np.power(N, self.alpha) + self.B / np.power(D, self.beta)

    @classmethod
    def from_x(cls, x: np.ndarray) -> Law:
        a, b, e, alpha, beta = (float(v) for v in x)
        return cls(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _terms(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """(..., 3, n): a - alpha log N, b - beta log D, e for parameters x (..., 5)."""
    a, b, e, alpha, beta = (x[..., i, None] for i in range(5))
    return np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, a.shape[:-1] + log_n.shape)], -2)


def _huber(residual: np.ndarray, delta: float) -> np.ndarray:
    """Huber(delta) / delta, summed over the last axis."""
    r = np.abs(residual)
    return np.where(r <= delta, 0.5 * r * r / delta, r - 0.5 * delta).sum(-1)


def _objective(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float):
    """Huber(delta) of the log residuals, / delta, and its gradient in x = (a, b, e, alpha, beta)."""
    terms = _terms(x, log_n, log_d)  # (3, n)
    top = terms.max(0)
    weights = np.exp(terms - top)
    total = weights.sum(0)
    residual = top + np.log(total) - log_l
    slope = np.clip(residual / delta, -1.0, 1.0)  # dHuber/dr / delta
    w = weights * (slope / total)  # d(LSE)/d(term), weighted by the residual's slope
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] @ log_n), -(w[1] @ log_d)])
    return float(_huber(residual, delta)), grad


def _lbfgs(x0: np.ndarray, data: tuple[np.ndarray, ...], delta: float) -> tuple[np.ndarray, float]:
    result = minimize(
        _objective,
        x0,
        args=(*data, delta),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-9},
    )
    return result.x, float(result.fun)


def grid_starts() -> np.ndarray:
    """The grid of starting points, (4500, 5) in x = (a, b, e, alpha, beta) order."""
    return np.array(list(itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])))


MAX_LOG_FLOAT = math.log(np.finfo(float).max)


def _representable(x: np.ndarray, value: float) -> bool:
    """A finite optimum whose E, A and B (exp of its first three parameters) lie within float range: a fit that
    drifts past log ~709 has diverged."""
    return bool(np.isfinite(value) and np.all(x[:3] < MAX_LOG_FLOAT))


@dataclass(frozen=True)
class LawFit:
    law: Law
    x: np.ndarray  # the optimum in (a, b, e, alpha, beta)
    objective: float  # Huber / delta at the optimum
    starts: np.ndarray  # the starts, best first (reused by the bootstrap)


def check_cells(N: Sequence[float], D: Sequence[float], L: Sequence[float]) -> None:
    """ValueError, one line, when the cells cannot determine the five parameters."""
    n = len(L)
    if not len(N) == len(D) == n:
        raise ValueError(f"N, D and L differ in length ({len(N)}, {len(D)}, {n})")
    if n < len(PARAMETERS):
        raise InputError(
            f"{n} cell(s) to fit {len(PARAMETERS)} parameters ({', '.join(PARAMETERS)}): the fit needs at least "
            f"{len(PARAMETERS)}; add ladder.sizes or budgets"
        )
    if not all(math.isfinite(v) and v > 0 for v in (*N, *D, *L)):
        raise ValueError("N, D and the losses must be finite and > 0")


def fit_law(
    N: Sequence[float],
    D: Sequence[float],
    L: Sequence[float],
    *,
    starts: np.ndarray | None = None,
    refine: int = 32,
    delta: float = HUBER_DELTA,
) -> LawFit:
    """Approach 3: L-BFGS from each of ``starts`` (default: the ``refine`` points of :func:`grid_starts` where
    the objective is lowest); the best optimum."""
    check_cells(N, D, L)
    data = (np.log(np.asarray(N, float)), np.log(np.asarray(D, float)), np.log(np.asarray(L, float)))
    if starts is None:  # the grid points of lowest objective
        grid = grid_starts()
        at_grid = _huber(logsumexp(_terms(grid, data[0], data[1]), axis=-2) - data[2], delta)
        starts = grid[np.argsort(at_grid, kind="stable")[:refine]]
    starts = np.atleast_2d(starts)
    results = [_lbfgs(x0, data, delta) for x0 in starts]
    values = np.array([v if _representable(x, v) else np.inf for x, v in results])
    if not np.isfinite(values).any():
        raise InputError(
            f"no scaling law fits these {len(L)} cells: every fit diverged (E, A or B beyond float range); the "
            "losses do not fall as a power law in N and D, often because the cells are undertrained: raise the "
            "budgets (ladder.flops)"
        )
    order = np.argsort(values, kind="stable")
    best_x, best_value = results[order[0]]
    return LawFit(Law.from_x(best_x), best_x, best_value, starts[order])


def bootstrap_laws(
    N: Sequence[float],
    D: Sequence[float],
    L: Sequence[float],
    full: LawFit,
    *,
    samples: int = 200,
    seed: int = 0,
    starts: int = 2,
    delta: float = HUBER_DELTA,
) -> list[Law]:
    """Approach 3 refitted on ``samples`` resamples of the cells (with replacement), each started from the
    full-data optimum and the ``starts`` best grid starts of the full fit."""
    rng = np.random.default_rng(seed)
    n, d, loss = (np.asarray(v, float) for v in (N, D, L))
    x0s = np.vstack([full.x, full.starts[:starts]])
    laws = []
    for _ in range(samples):
        pick = rng.integers(0, len(loss), len(loss))
        data = (np.log(n[pick]), np.log(d[pick]), np.log(loss[pick]))
        # the best optimum a law can represent; a resample whose every fit diverged is dropped
        kept = [
            (x, value) for x, value in (_lbfgs(x0, data, delta) for x0 in x0s) if _representable(x, value)
        ]
        if kept:
            laws.append(Law.from_x(min(kept, key=lambda r: r[1])[0]))
    return laws


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.asarray(values, float), [tail, 100 - tail])
    return float(low), float(high)


def closed_form_optimum(law: Law, C: float) -> tuple[float, float]:
    """Hoffmann et al.'s eq. (4) with C = 6 N D: (N_opt, D_opt) =
    (G (C/6)^a, G^-1 (C/6)^b), a = beta / (alpha + beta), b = alpha / (alpha + beta),
    G = (alpha A / (beta B))^(1 / (alpha + beta))."""
    s = law.alpha + law.beta
    G = (law.alpha * law.A / (law.beta * law.B)) ** (1 / s)
    return G * (C / 6) ** (law.beta / s), (C / 6) ** (law.alpha / s) / G


def optimum_over(law: Law, C: float, params: np.ndarray, flops_per_token: np.ndarray) -> int:
    """Index of the shape minimising L(N, C / F) among shapes of ``params`` N and FLOPs per token F."""
    return int(np.argmin(law.loss(params, C / flops_per_token)))


@dataclass(frozen=True)
class Parabola:
    """One isoFLOP profile: L = c0 + c1 x + c2 x^2 in x = log N."""

    flops: float
    coefficients: tuple[float, float, float]
    n_min: float
    n_max: float

    @property
    def n_opt(self) -> float | None:
        """The vertex, or None when the profile is not convex (no minimum)."""
        _, c1, c2 = self.coefficients
        return math.exp(-c1 / (2 * c2)) if c2 > 0 else None

    @property
    def inside(self) -> bool:
        """The minimum lies within the sizes run at this budget."""
        n = self.n_opt
        return n is not None and self.n_min <= n <= self.n_max


def isoflop_parabola(flops: float, N: Sequence[float], L: Sequence[float]) -> Parabola:
    """Least-squares parabola of L in log N over one budget's cells (at least 3 sizes)."""
    if len(set(N)) < 3:
        raise InputError(f"the isoFLOP profile at {flops:.3g} FLOPs needs >= 3 sizes, got {len(set(N))}")
    c2, c1, c0 = np.polyfit(np.log(np.asarray(N, float)), np.asarray(L, float), 2)
    return Parabola(flops, (float(c0), float(c1), float(c2)), float(min(N)), float(max(N)))


def power_law_exponent(C: Sequence[float], Y: Sequence[float]) -> tuple[float, float]:
    """(exponent, log-prefactor) of Y = k C^exponent by least squares in log-log."""
    slope, intercept = np.polyfit(np.log(np.asarray(C, float)), np.log(np.asarray(Y, float)), 1)
    return float(slope), float(intercept)
