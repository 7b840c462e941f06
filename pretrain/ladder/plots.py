"""A fitted ladder's three plots (matplotlib, Agg): loss vs compute with the compute-optimal frontier, the
isoFLOP profiles with their parabolas, and predicted vs actual loss (the held-out cell marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pretrain.io import atomic_write
from pretrain.ladder.fit import PARAMETERS, Law
from pretrain.ladder.shapes import Family


def plot_ladder(report: dict[str, Any], shapes: Family, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = Law(**{k: report["fit"][k] for k in PARAMETERS})
    cells = report["cells"]
    sizes = sorted({c["N"] for c in cells})
    colors = {n: plt.cm.viridis(i / max(1, len(sizes) - 1)) for i, n in enumerate(sizes)}
    title = f"{report['objective']} ladder"
    paths = {}

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for c in cells:
        ax.scatter(c["C"], c["loss"], color=colors[c["N"]], marker="*" if c["held_out"] else "o",
                   s=120 if c["held_out"] else 30, zorder=3)  # fmt: skip
    for n in sizes:
        ax.plot([], [], "o", color=colors[n], label=f"N = {n:,.0f}")
    C = np.geomspace(min(c["C"] for c in cells) / 2, max(c["C"] for c in cells) * 4, 60)
    frontier = [law.loss(shapes.params, c / shapes.flops_per_token).min() for c in C]
    ax.plot(C, frontier, "k--", lw=1, label="compute-optimal frontier (fit)")
    ax.set(
        xscale="log", xlabel="training FLOPs C", ylabel="validation loss", title=f"{title}: loss vs compute"
    )
    ax.legend(fontsize=7)
    paths["loss_vs_compute"] = _save(fig, out / "loss_vs_compute.png")

    fig, ax = plt.subplots(figsize=(6, 4.2))
    iso = report["isoflop"].get("budgets", [])
    for i, b in enumerate(iso):
        color = plt.cm.plasma(i / max(1, len(iso) - 1))
        group = [c for c in cells if not c["held_out"] and abs(c["C"] / b["flops"] - 1) < 0.2]
        ax.scatter([c["N"] for c in group], [c["loss"] for c in group], color=color)
        n = np.geomspace(b["sizes"][0] / 1.5, b["sizes"][1] * 1.5, 50)
        c0, c1, c2 = b["coefficients"]
        ax.plot(n, c0 + c1 * np.log(n) + c2 * np.log(n) ** 2, color=color, label=f"C = {b['flops']:.3g}")
        if b["N_opt"] is not None:
            ax.axvline(b["N_opt"], color=color, ls=":", lw=1)
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="validation loss",
           title=f"{title}: isoFLOP profiles")  # fmt: skip
    if iso:
        ax.legend(fontsize=7)
    else:
        ax.text(
            0.5, 0.5, report["isoflop"].get("skipped", ""), ha="center", va="center", transform=ax.transAxes
        )
    paths["isoflop"] = _save(fig, out / "isoflop.png")

    fig, ax = plt.subplots(figsize=(4.6, 4.4))
    for c in cells:
        ax.scatter(c["loss"], c["predicted"], color="C3" if c["held_out"] else "C0",
                   marker="*" if c["held_out"] else "o", s=120 if c["held_out"] else 25, zorder=3)  # fmt: skip
    lo = min(min(c["loss"], c["predicted"]) for c in cells)
    hi = max(max(c["loss"], c["predicted"]) for c in cells)
    ax.plot([lo, hi], [lo, hi], "k:", lw=1)
    held = report.get("held_out")
    note = f"held out: {held['rel_error'] * 100:+.2f} %" if held else "no cell held out"
    ax.set(xlabel="actual loss", ylabel="predicted loss", title=f"{title}: predicted vs actual\n{note}")
    paths["predicted_vs_actual"] = _save(fig, out / "predicted_vs_actual.png")
    return paths


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    for ax in fig.axes:  # decades only: minor labels of a log axis overlap
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))  # no half-drawn plot on a failure
    plt.close(fig)
    return str(path)
