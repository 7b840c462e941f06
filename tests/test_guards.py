"""Fault injection on the CPU (``tests/fault_run.py``), 1 process and 2 gloo ranks: a NaN gradient is skipped,
a loss spike is rolled back and its data skipped, a hang dumps the stacks and exits, a full disk keeps the
previous checkpoint."""

from __future__ import annotations

import pytest
import torch
from fault_run import main as fit_with_faults
from training_utils import (  # noqa: F401
    metric_by_step,
    model_weights,
    read_metrics,
    tiny_recipe,
    tiny_world,
)

from pretrain.training.checkpoint import read

STEPS = 8


def recipe(directory, world, **sections):
    directory.mkdir()
    trainer = {"max_steps": STEPS, "val_check_interval": 100, **sections.pop("trainer", {})}
    return tiny_recipe(
        directory,
        world,
        "gpt",
        trainer=trainer,
        checkpoint={"every_n_steps": 100, "save_top_k": 0},
        **sections,
    )


def guard_state(run_dir) -> dict:
    return read(run_dir / "checkpoints" / "last.ckpt")["callbacks"]["StepGuard"]


def test_nan_gradient_step_is_skipped_and_equals_a_run_without_that_update(tmp_path, tiny_world):  # noqa: F811
    guarded = recipe(tmp_path / "nan", tiny_world)
    reference = recipe(tmp_path / "undo", tiny_world)
    assert fit_with_faults("nan@3", ["fit", str(guarded)]) == 0
    assert fit_with_faults("undo@3", ["fit", str(reference)]) == 0
    a, b = model_weights(tmp_path / "nan/run/checkpoints/last.ckpt"), model_weights(
        tmp_path / "undo/run/checkpoints/last.ckpt"
    )
    for key in b:
        assert torch.equal(a[key], b[key]), key
    state = guard_state(tmp_path / "nan" / "run")
    assert state["nonfinite_steps"] == 1 and [e["step"] for e in state["events"]] == [3]
    logged = metric_by_step(read_metrics(tmp_path / "nan" / "run"), "guard/nonfinite_steps")
    assert logged == {3: 1.0}
