"""The scaling-law fitter (pretrain.ladder.fit) against data drawn from known laws, and against Hoffmann et al.
(2022)'s closed-form compute-optimal allocation."""

import math

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pretrain.ladder.fit import (
    Law,
    bootstrap_laws,
    closed_form_optimum,
    fit_law,
    interval,
    isoflop_parabola,
    power_law_exponent,
)

# a tiny-scale law (losses in nats per character) and a Chinchilla-scale one (Hoffmann et al.'s approach 3 fit)
TINY = Law(E=1.1, A=40.0, alpha=0.32, B=300.0, beta=0.29)
CHINCHILLA = Law(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)


def grid(law: Law, sizes, tokens, noise: float = 0.0, seed: int = 0):
    N, D = (a.ravel() for a in np.meshgrid(sizes, tokens, indexing="ij"))
    L = law.loss(N, D) * np.exp(np.random.default_rng(seed).normal(0, noise, N.size))
    return N, D, L


@pytest.mark.parametrize(
    ("law", "sizes", "tokens"),
    [
        (TINY, np.geomspace(2e4, 8e5, 5), np.geomspace(5e4, 1e7, 5)),
        (CHINCHILLA, np.geomspace(7e7, 1.6e10, 5), np.geomspace(5e9, 4e11, 5)),
    ],
)
def test_noise_free_cells_give_back_the_law(law, sizes, tokens):
    with threadpool_limits(1):
        fit = fit_law(*grid(law, sizes, tokens))
    for name in ("E", "A", "alpha", "B", "beta"):
        assert getattr(fit.law, name) == pytest.approx(getattr(law, name), rel=2e-3), name


def test_noisy_cells_recover_the_exponents_within_their_bootstrap_intervals():
    N, D, L = grid(TINY, np.geomspace(2e4, 8e5, 5), np.geomspace(5e4, 1e7, 4), noise=0.003)
    with threadpool_limits(1):
        fit = fit_law(N, D, L)
        laws = bootstrap_laws(N, D, L, fit, samples=40, seed=1)
    assert len(laws) == 40
    for name in ("alpha", "beta", "E"):
        low, high = interval([getattr(b, name) for b in laws])
        assert low <= getattr(TINY, name) <= high, (name, low, high)
    assert fit.law.alpha == pytest.approx(TINY.alpha, abs=0.05)
    assert fit.law.beta == pytest.approx(TINY.beta, abs=0.05)
    # the fit predicts a cell beyond its grid (4x the largest N and D) within 1 %
    assert fit.law.loss(3.2e6, 4e7) == pytest.approx(TINY.loss(3.2e6, 4e7), rel=0.01)


def test_fewer_cells_than_parameters_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^4 cell\(s\) to fit 5 parameters") as err:
        fit_law([1e5, 2e5, 3e5, 4e5], [1e6] * 4, [2.0, 1.9, 1.8, 1.7])
    assert "\n" not in str(err.value)


def test_closed_form_allocation_is_the_minimum_along_C_equal_6ND():
    """Hoffmann et al.'s eq. (4): N_opt = G (C/6)^a; the numerical minimum of L(N, C / 6N) agrees."""
    C = 1e21
    n_opt, d_opt = closed_form_optimum(CHINCHILLA, C)
    assert 6 * n_opt * d_opt == pytest.approx(C)
    N = np.geomspace(n_opt / 10, n_opt * 10, 200001)
    assert N[np.argmin(CHINCHILLA.loss(N, C / (6 * N)))] == pytest.approx(n_opt, rel=1e-4)
    a = CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)
    assert closed_form_optimum(CHINCHILLA, 10 * C)[0] / n_opt == pytest.approx(10**a)


def test_isoflop_parabolas_find_the_minimum_and_its_power_law():
    """Approach 2 on profiles sampled around the true optimum: N_opt ~ C^(beta / (alpha + beta))."""
    budgets = [1e18, 1e19, 1e20]
    optima = []
    for C in budgets:
        n_true = closed_form_optimum(CHINCHILLA, C)[0]
        N = n_true * np.geomspace(1 / 3, 3, 7)
        parabola = isoflop_parabola(C, N, CHINCHILLA.loss(N, C / (6 * N)))
        assert parabola.inside and parabola.n_opt == pytest.approx(n_true, rel=0.05)
        optima.append(parabola.n_opt)
    a, _ = power_law_exponent(budgets, optima)
    assert a == pytest.approx(CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta), abs=0.01)
    below = isoflop_parabola(1e18, [1e9, 2e9, 4e9], CHINCHILLA.loss(np.array([1e9, 2e9, 4e9]), 1e18 / 6e9))
    assert not below.inside  # the optimum (~0.1B) lies below every size run: the sizes do not span the budget
    assert math.isfinite(below.coefficients[0])


def test_a_bootstrap_resample_whose_optimum_leaves_float_range_is_dropped(monkeypatch):
    """A resample of few cells can drive log A past ~709 (exp overflows): it is dropped as a diverged resample
    instead of ending the ladder with an OverflowError (seen on the reduced CI ladder)."""
    from pretrain.ladder import fit

    N, D = np.array([1e5, 2e5, 4e5, 1e5, 2e5, 4e5]), np.array([1e7, 1e7, 1e7, 4e7, 4e7, 4e7])
    L = Law(E=1.5, A=400.0, alpha=0.34, B=410.0, beta=0.28).loss(N, D)
    full = fit_law(N, D, L)
    calls = iter(range(10_000))

    def lbfgs(x0, data, delta):  # every other resample "converges" to log A = 1000
        x = np.array(x0, float)
        if next(calls) % 2 == 0:
            x[0] = 1000.0
        return x, 0.0

    monkeypatch.setattr(fit, "_lbfgs", lbfgs)
    laws = bootstrap_laws(N, D, L, full, samples=4, starts=0)
    assert len(laws) == 2 and all(math.isfinite(law.A) for law in laws)


def test_a_degenerate_law_evaluates_without_numpy_warnings():
    """A bootstrap fit with a large negative exponent (N^alpha underflows to 0: A / 0) gives inf, silently:
    the MLM ladder's report printed numpy's `divide by zero` warning to the user."""
    law = Law(E=0.8, A=4911.0, alpha=-40.2, B=72.1, beta=0.28)
    with np.errstate(all="raise"):
        loss = law.loss(np.array([2.2e5, 1e300]), np.array([1e6, 1e6]))
    assert np.isfinite(loss[0]) and np.isinf(loss[1])


def test_the_full_fit_keeps_the_best_optimum_a_law_can_represent(monkeypatch):
    """A start whose optimum drifts past float range (log A = 1000, the lowest objective) is passed over for the
    best representable one (the T5 ladder's fit ended in `OverflowError: math range error`); when every start
    diverges the fit is refused in one line naming the fix."""
    from pretrain.ladder import fit

    N, D = np.array([1e5, 2e5, 4e5, 1e5, 2e5, 4e5]), np.array([1e7, 1e7, 1e7, 4e7, 4e7, 4e7])
    L = TINY.loss(N, D)
    starts = np.array([[1.0, 2.0, 0.0, 0.5, 0.5], [3.0, 4.0, 0.1, 0.3, 0.3], [5.0, 5.0, 0.2, 0.2, 0.2]])

    def lbfgs(x0, data, delta):  # the first start "converges" beyond float range at the lowest objective
        x = np.array(x0, float)
        if x0[0] == 1.0:
            x[0] = 1000.0
            return x, -1.0
        return x, float(x0[0])

    monkeypatch.setattr(fit, "_lbfgs", lbfgs)
    best = fit_law(N, D, L, starts=starts)
    assert best.x[0] == 3.0 and best.law.A == pytest.approx(math.exp(3.0))
    with pytest.raises(ValueError, match=r"^no scaling law fits these 6 cells: .*ladder\.flops") as err:
        fit_law(N, D, L, starts=starts[:1])
    assert "\n" not in str(err.value)
