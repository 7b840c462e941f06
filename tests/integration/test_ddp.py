"""Data parallel on CPU (gloo, 2 processes launched by Lightning from the CLI): same loss curve as one process with
the whole batch, and exact resume after a SIGKILL of every rank or of rank 1 only (rank 0 then stops with one
line naming it)."""

from __future__ import annotations

import random

import pytest
import torch
from training_utils import (
    Background,
    fit_and_kill,
    fit_and_signal,
    metric_by_step,
    model_weights,
    read_metrics,
    run_cli,
    tiny_recipe,
)

DDP = {"name": "ddp", "ddp": {"process_group_backend": "gloo"}}


@pytest.mark.slow
def test_two_processes_match_one_process_with_twice_the_batch(tmp_path, tiny_world):
    """10 MLM steps, per-device batch b=2 on 2 ranks vs b=4 on 1 rank, accumulation 2: the same samples and
    masks, and the same loss normalisation although the target count varies per micro-batch and rank."""
    runs = {}
    for name, devices, micro in (("one", 1, 4), ("two", 2, 2)):
        (tmp_path / name).mkdir()
        recipe = tiny_recipe(
            tmp_path / name,
            tiny_world,
            "bert",
            data={"micro_batch_size": micro},
            strategy=DDP if devices > 1 else {"name": "auto"},
            trainer={
                "devices": devices,
                "max_steps": 10,
                "accumulate_grad_batches": 2,
                "val_check_interval": 100,
            },
            checkpoint={"every_n_steps": 100, "save_top_k": 0},
        )
        runs[name] = Background("fit", str(recipe), log=tmp_path / f"{name}.log")
    curves = {}
    for name, run in runs.items():
        run.wait()
        curves[name] = metric_by_step(read_metrics(tmp_path / name / "run"), "train/loss")
    assert sorted(curves["one"]) == list(range(1, 11))
    for step, loss in curves["one"].items():
        assert abs(curves["two"][step] - loss) <= 1e-5 * abs(loss), (step, loss, curves["two"][step])
    assert len(set(curves["one"].values())) > 1  # the model did learn: the curve is not flat


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    ["gpt", pytest.param("bert", marks=pytest.mark.heavy), pytest.param("t5", marks=pytest.mark.heavy)],
)
def test_ddp_sigkill_then_resume_auto_is_bitwise_exact(tmp_path, tiny_world, kind):
    runs = {}
    for name in ("full", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = tiny_recipe(
            tmp_path / name,
            tiny_world,
            kind,
            strategy=DDP,
            model={"dropout": 0.1},
            trainer={"devices": 2, "max_steps": 6, "val_check_interval": 3},
            checkpoint={"every_n_steps": 1, "save_top_k": 1},
        )
    reference = Background("fit", str(runs["full"]), log=tmp_path / "full.log")
    at = random.Random(0).randint(1, 3)
    if kind == "t5":  # one rank killed: the survivor stops with one line naming it, then the job is rerun
        step, status, output = fit_and_signal(runs["killed"], tmp_path / "killed" / "run", at, rank=1)
        errors = [line for line in output.splitlines() if line.startswith("pretrain fit: error: ")]
        assert status == 2 and len(errors) == 1 and "Traceback" not in output, output
        assert (
            errors[0].startswith("pretrain fit: error: rank 1 died") and "rerun the same command" in errors[0]
        )
    else:  # every rank killed, as a scheduler kills a job
        step = fit_and_kill(runs["killed"], tmp_path / "killed" / "run", kill_at_step=at)
    assert step < 6
    run_cli("fit", str(runs["killed"]))
    reference.wait()
    full = model_weights(tmp_path / "full/run/checkpoints/last.ckpt")
    resumed = model_weights(tmp_path / "killed/run/checkpoints/last.ckpt")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
