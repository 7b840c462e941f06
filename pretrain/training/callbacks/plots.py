"""Offline curves of a run from its CSV log (``<run_dir>/logs/version_*/metrics.csv``, Lightning's CSVLogger):
train / val loss, learning rate and tokens/s against the optimizer step, one PNG; several runs overlay. A run
evaluated during fit (``pretrain.training.callbacks.in_loop_eval``) gets a fourth panel: each task's ``acc`` and the
CORE-style ``eval/core``.

tokens/s is measured, not logged: the throughput monitor's cumulative ``train/tokens_per_device`` (tokens) over its
cumulative ``train/seconds`` (seconds), differenced between consecutive logged steps. A resumed run's versions
are read in order and joined; a version supersedes the earlier versions' rows from its first step on (they are
of a branch the run left: a resume from an earlier checkpoint, steps logged after the last checkpoint of a
killed run, or a run that ``resume=null`` replaced), so that a curve is one run's.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from pretrain.io import atomic_write

CURVES = ("loss", "learning rate", "tokens/s", "in-loop evaluation")


def is_eval_curve(name: str) -> bool:
    """``eval/core`` and ``eval/<task>/acc``: the accuracies the evaluation panel shows."""
    return name == "eval/core" or (name.startswith("eval/") and name.endswith("/acc"))


def metrics_files(run_dir: str | Path) -> list[Path]:
    """The run's CSV logs in version order; FileNotFoundError naming the run when there is none."""
    logs = Path(run_dir) / "logs"
    files = sorted(logs.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not files:
        raise FileNotFoundError(
            f"{run_dir} has no CSV log ({logs}/version_*/metrics.csv); train with logger.csv=true"
        )
    return files


def metrics_rows(run_dir: str | Path) -> list[list[dict[str, str]]]:
    """The rows of each CSV version of the run (version order) that are still the run's: a version's first
    logged step is where its launch started (after the checkpoint it resumed, or step 1 of a fresh run in the
    directory), so an earlier version's rows at that step or later belong to a branch the run left (a
    ``resume=PATH`` from an earlier checkpoint, the steps a killed run logged after its last checkpoint, the
    run ``resume=null`` replaced). Joined as they were, curves and the last validation mixed two runs."""
    versions: list[list[dict[str, str]]] = []
    for path in metrics_files(run_dir):
        with path.open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("step") not in (None, "")]
        if rows:
            first = min(_step(row) for row in rows)
            versions = [[row for row in kept if _step(row) < first] for kept in versions]
        versions.append(rows)
    return versions


def _step(row: dict[str, str]) -> int:
    return int(float(row["step"]))


def read_curves(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train/loss", "val/loss", "train/lr", "tokens/s", "eval/...": ...}`` -> [(step, value)] from the
    run's CSV logs (``eval/...``: the ``is_eval_curve`` columns present)."""
    columns = ("train/loss", "val/loss", "train/lr")
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in (*columns, "tokens/s")}
    clock: tuple[float, float] | None = None  # (tokens, seconds) at the previous throughput row
    for rows in metrics_rows(run_dir):
        for row in rows:
            step = _step(row)
            for name in (*columns, *filter(is_eval_curve, row)):
                if row.get(name) not in (None, ""):
                    curves.setdefault(name, []).append((step, float(row[name])))
            if row.get("train/tokens_per_device") not in (None, "") and row.get("train/seconds") not in (
                None,
                "",
            ):
                tokens, seconds = float(row["train/tokens_per_device"]), float(row["train/seconds"])
                if clock is not None and seconds > clock[1] and tokens > clock[0]:
                    curves["tokens/s"].append((step, (tokens - clock[0]) / (seconds - clock[1])))
                clock = (tokens, seconds)
        clock = None  # a resumed run restarts the monitor's counters
    return curves


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """One PNG with three panels (loss, learning rate, tokens/s vs step), and a fourth of in-loop evaluation
    accuracies when a run has them; every run overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_curves(run_dir) for run_dir in run_dirs]
    panels = 4 if any(is_eval_curve(name) for curves in runs for name in curves) else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for index, (run_dir, curves) in enumerate(zip(run_dirs, runs)):
        color, label = f"C{index}", Path(run_dir).name
        for name, style in (("train/loss", "-"), ("val/loss", "o--")):
            if curves[name]:
                axes[0].plot(*zip(*curves[name]), style, color=color, label=f"{label} {name}", markersize=4)
        for ax, name in ((axes[1], "train/lr"), (axes[2], "tokens/s")):
            if curves[name]:
                ax.plot(*zip(*curves[name]), color=color, label=label)
        for k, name in enumerate(sorted(filter(is_eval_curve, curves))):
            style = "o-" if name == "eval/core" else ("o--", "s:", "^-.", "v--", "d:")[k % 5]
            axes[-1].plot(*zip(*curves[name]), style, color=color, label=f"{label} {name[5:]}", markersize=4)
    losses = [v for ax_line in axes[0].get_lines() for v in ax_line.get_ydata() if math.isfinite(v)]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
        axes[0].set_yscale("log")
    for ax, title in zip(axes, CURVES):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return out
