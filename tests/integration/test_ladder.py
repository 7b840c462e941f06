"""`pretrain ladder` end to end at a reduced size: recipes/ladder-tiny.yaml with 3 sizes x 3 budgets (about
1e11 FLOPs per cell at most), killed mid-way and run again (nothing finished reruns, the killed cell resumes),
its held-out cell predicted, and the compute-optimal model for a budget printed and runnable."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from training_utils import REPO_ROOT, cli_command, cli_env, run_cli

from pretrain import config
from pretrain.ladder.fit import Law, closed_form_optimum

# the CI ladder: recipes/ladder-tiny.yaml with smaller sizes, budgets, batches and validation (each cell 60-1400
# optimizer steps of 512 tokens); the largest cell, d64-l2 at 1.2e11 FLOPs, is held out
REDUCED = [
    "ladder.sizes=[{d_model: 32, n_layer: 1}, {d_model: 32, n_layer: 2}, {d_model: 64, n_layer: 2}]",
    "ladder.flops=[3e10, 6e10, 1.2e11]",
    "ladder.min_steps=30",
    "ladder.val_batches=16",
    "ladder.bootstrap=30",
    "data.micro_batch_size=8",
    "logger.wandb.enabled=false",
    "logger.curves=false",  # each cell's curves.png: ~1.4 CPU-s of matplotlib, 9 times (the ladder draws its own)
]
HELD_OUT_TOLERANCE = (
    0.05  # the reduced ladder's prediction of its held-out cell (the full ladder's target: 3 %)
)


def _wait_for(condition, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


@pytest.mark.slow
def test_reduced_ladder_resumes_fits_and_predicts_its_held_out_cell(tmp_path):
    out = tmp_path / "ladder"
    args = ["ladder", "recipes/ladder-tiny.yaml", "--out", str(out), *REDUCED]
    # first call: killed (with its cells) once one cell has finished and another has a checkpoint
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            cli_command(*args), cwd=REPO_ROOT, env=cli_env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    runs = out / "runs"

    def one_done_one_started() -> bool:
        done = {p.parent for p in runs.glob("*/result.json")}
        started = {p.parents[1] for p in runs.glob("*/checkpoints/*.ckpt")} - done
        return bool(done) and bool(started)

    try:
        _wait_for(one_done_one_started, 900, "a finished cell and a checkpointed one")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finished = {p.parent.name: p.stat().st_mtime_ns for p in runs.glob("*/result.json")}
    killed = [
        p.parents[1].name for p in runs.glob("*/checkpoints/*.ckpt") if p.parents[1].name not in finished
    ]

    # second call: trains only what is missing, then fits
    second = run_cli(*args, timeout=1800)
    for name, mtime in finished.items():
        assert (runs / name / "result.json").stat().st_mtime_ns == mtime, f"{name} was trained again"
        assert (runs / name / "fit.log").read_text().count("== pretrain ladder:") == 1
    resumed = killed[0]
    log = (runs / resumed / "fit.log").read_text()
    # killed mid-training: restored from its checkpoint; killed after its last step but before result.json: its
    # fit has nothing left to train and the cell is only finished
    continued = "Restoring states from the checkpoint" in log or "== pretrain fit: nothing to train ==" in log
    assert log.count("== pretrain ladder:") == 2 and continued, log[-2000:]

    report = json.loads((out / "ladder.json").read_text())
    held = report["held_out"]
    assert held["cell"] == "d64-l2-c1.2e11" and held["actual"] == pytest.approx(
        json.loads((runs / held["cell"] / "result.json").read_text())["loss"]
    )
    assert abs(held["rel_error"]) < HELD_OUT_TOLERANCE, (held, second.stdout)
    assert report["fit"]["cells"] == 8 and len(report["fit"]["bootstrap"]["laws"]) > 0
    assert all(Path(p).is_file() for p in report["plots"].values())
    assert "held out d64-l2-c1.2e11: predicted" in second.stdout

    # the compute-optimal model for the budget where the fit's closed form (C = 6 N D) puts N_opt at the held-out
    # cell's N: printed with its interval, and its overrides make a valid run of the recipe
    fit = report["fit"]
    law = Law(**{k: fit[k] for k in ("E", "A", "alpha", "B", "beta")})
    n_opt_at_1 = closed_form_optimum(law, 6.0)[0]  # N_opt = n_opt_at_1 (C / 6)^a
    budget = 6 * (held["N"] / n_opt_at_1) ** (1 / fit["a"])
    query = run_cli("ladder", str(out), "--budget", f"{budget:.6g}").stdout
    assert "compute-optimal at" in query and "non-embedding parameters [" in query, query
    n_printed = float(query.split("N = ")[1].split()[0].replace(",", ""))
    assert held["N"] / 10 < n_printed < held["N"] * 10, (
        query
    )  # MFU's F (head, attention) moves it from 6 N D's
    overrides = query.split("overrides: ")[1].split()
    run, _ = config.load("recipes/ladder-tiny.yaml", [*REDUCED, *overrides])
    assert run.trainer.max_steps > 0 and run.model.d_model % 32 == 0


def test_budgets_too_small_for_the_sizes_are_refused_before_the_tokenizer_and_corpus_are_made(tmp_path):
    """The cells' steps need no tokenizer (a decoder's FLOPs per token come from its shape): the refusal came
    after `pretrain tokenizer` and `prepare` had run on the recipe's corpus."""
    tokenizer = tmp_path / "tokenizer.json"
    out = run_cli("ladder", "recipes/ladder-tiny.yaml", "--out", str(tmp_path / "ladder"), "ladder.flops=[1e9]",
                  f"tokenizer.path={tokenizer}", f"data.sources.0.prepared={tmp_path / 'data'}", check=False)  # fmt: skip
    assert out.returncode == 2 and "the sizes do not span the budgets: 4 cell(s)" in out.stderr, out.stderr
    assert not tokenizer.exists() and not (tmp_path / "data").exists() and not (tmp_path / "ladder").exists()


@pytest.mark.heavy  # the executor is prepare's (tested on Ray there); this adds the ladder's cells on it
def test_a_ladder_on_ray_gives_every_cell_the_local_ladders_loss(tmp_path):
    small = [
        "ladder.sizes=[{d_model: 32, n_layer: 1}, {d_model: 32, n_layer: 2}]",
        *REDUCED[1:],
    ]
    reports = {}
    for executor in ("local", "ray"):
        out = tmp_path / executor
        run_cli("ladder", "recipes/ladder-tiny.yaml", "--out", str(out), "--executor", executor,
                "--workers", "2", *small, timeout=1800)  # fmt: skip
        reports[executor] = {
            p.parent.name: json.loads(p.read_text())["loss"] for p in (out / "runs").glob("*/result.json")
        }
        assert json.loads((out / "ladder.json").read_text())["fit"]["cells"] == 5
    assert len(reports["ray"]) == 6 and reports["ray"] == reports["local"]
