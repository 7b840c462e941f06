"""Running a ladder's cells: each one ``pretrain fit DIR/runs/<cell>/recipe.yaml`` in its own process, as
datatrove tasks on the executors ``pretrain prepare`` uses (``pretrain.datamodules.executors``): local processes,
a SLURM job array or Ray tasks.

A cell is *done* when ``result.json`` (its final validation loss) exists, *failed* when ``failed.json`` does
(exit status, log), else *pending*; a pending cell with checkpoints resumes from the newest (``resume=auto``),
so a second call reruns nothing finished and continues a killed cell. Each task holds a lock on its cell while
it trains, so two calls (or a resubmitted SLURM array) never train one cell twice at once.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from datatrove.pipeline.base import PipelineStep

from pretrain.io import HELD_BY_PARENT, atomic_write_text, exclusive, lock_path
from pretrain.ladder.plan import Cell, Plan

RESULT_FILE, FAILED_FILE, LOG_FILE = "result.json", "failed.json", "fit.log"
Status = Literal["done", "failed", "pending"]


def status(cell: Cell) -> Status:
    run_dir = Path(cell.run_dir)
    if (run_dir / RESULT_FILE).is_file():
        return "done"
    return "failed" if (run_dir / FAILED_FILE).is_file() else "pending"


def result(cell: Cell) -> dict[str, Any]:
    return json.loads((Path(cell.run_dir) / RESULT_FILE).read_text())


def failure(cell: Cell) -> dict[str, Any]:
    return json.loads((Path(cell.run_dir) / FAILED_FILE).read_text())


def final_validation(run_dir: Path) -> tuple[int, float] | None:
    """(step, val/loss) of the last validation in the run's CSV logs (every ``version_*``, resumes included; not
    the rows a later version superseded: ``metrics_rows``)."""
    from pretrain.training.callbacks.plots import metrics_rows

    last: tuple[int, float] | None = None
    if not any((run_dir / "logs").glob("version_*/metrics.csv")):
        return None
    for rows in metrics_rows(run_dir):
        for row in rows:
            if row.get("val/loss"):
                entry = (int(float(row["step"])), float(row["val/loss"]))
                last = entry if last is None or entry[0] >= last[0] else last
    return last


def fit_cell(cell: dict[str, Any], cwd: str, threads: int) -> str:
    """Train one cell (a ``Cell`` as a dict) to its end in a ``pretrain fit`` process and record the outcome;
    returns its status. Never raises for the cell's own failure: the other cells go on."""
    run_dir = Path(cell["run_dir"])
    try:
        with exclusive(run_dir, "`pretrain ladder` cell"):
            if (run_dir / RESULT_FILE).is_file():
                return "done"
            (run_dir / FAILED_FILE).unlink(missing_ok=True)
            env = {k: v for k, v in os.environ.items() if k != "PRETRAIN_OVERRIDES"}  # the plan is the cell
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            env[HELD_BY_PARENT] = str(lock_path(run_dir))  # the fit writes under this cell's lock
            start = time.monotonic()
            with (run_dir / LOG_FILE).open("a") as log:
                log.write(f"\n== pretrain ladder: {cell['name']} ({cell['steps']} steps) ==\n")
                log.flush()
                command = [sys.executable, "-m", "pretrain", "fit", cell["recipe"]]
                code = subprocess.run(
                    command, check=False, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
                ).returncode
            seconds = time.monotonic() - start
            final = final_validation(run_dir)
            if code == 0 and final is not None and final[0] >= cell["steps"] and math.isfinite(final[1]):
                body = {"name": cell["name"], "loss": final[1], "step": final[0], "seconds": seconds}
                atomic_write_text(run_dir / RESULT_FILE, json.dumps(body))
                return "done"
            lines = (run_dir / LOG_FILE).read_text(errors="replace").strip().splitlines()
            reason = (
                f"exit status {code}" if code else f"final validation {final} is not at step {cell['steps']}"
            )
            if code == 0 and final is not None and not math.isfinite(final[1]):
                reason = f"validation loss {final[1]}"
            body = {
                "name": cell["name"],
                "reason": reason,
                "last_line": lines[-1] if lines else "",
                "log": str(run_dir / LOG_FILE),
            }
            atomic_write_text(run_dir / FAILED_FILE, json.dumps(body))
            return "failed"
    except ValueError:  # the lock is held: another call trains this cell right now
        return "running"


class FitCells(PipelineStep):
    """datatrove step: task ``rank`` trains ``cells[rank]`` (:func:`fit_cell`)."""

    name = "fit (pretrain ladder)"
    type = "Trainer"

    def __init__(self, cells: list[dict[str, Any]], cwd: str, threads: int):
        super().__init__()
        self.cells, self.cwd, self.threads = cells, cwd, threads

    def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Any:
        outcome = fit_cell(self.cells[rank], self.cwd, self.threads)
        self.stat_update(outcome)
        return data


def run_cells(
    plan: Plan,
    out: Path,
    *,
    executor: Literal["local", "slurm", "ray"] = "local",
    workers: int | None = None,
    threads: int = 1,
    options: dict[str, Any] | None = None,
) -> list[Cell]:
    """Train the plan's pending and failed cells (``workers`` at a time; default: one per ``threads`` cores);
    returns the cells it started (under SLURM: submitted)."""
    from pretrain.datamodules.executors import build_executor

    todo = [c for c in plan.cells if status(c) != "done"]
    if not todo:
        return []
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // threads)
    cells = [
        {"name": c.name, "run_dir": c.run_dir, "recipe": c.recipe, "steps": c.steps} for c in todo
    ]  # fresh logs per call: datatrove would skip a rank its last call completed, whatever the outcome
    logs = out / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job = {"job_name": "pretrain-ladder", **(options or {})} if executor == "slurm" else dict(options or {})
    build_executor(executor, [FitCells(cells, plan.cwd, threads)], len(cells), workers, logs, job).run()
    return todo
