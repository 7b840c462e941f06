"""Fault injection on the CPU (``tests/fault_run.py``), 1 process and 2 gloo ranks: a NaN gradient is skipped,
a loss spike is rolled back and its data skipped, a hang dumps the stacks and exits, a full disk keeps the
previous checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_run import InjectedCrash
from fault_run import main as fit_with_faults
from training_utils import (
    REPO_ROOT,
    cli_env,
    metric_by_step,
    model_weights,
    read_metrics,
    tiny_recipe,
)

from pretrain.checkpoint import read

STEPS = 8
FAULT_RUN = Path(__file__).parents[1] / "fault_run.py"


def recipe(directory, world, **sections):
    directory.mkdir()
    trainer = {"max_steps": STEPS, "val_check_interval": 100, **sections.pop("trainer", {})}
    checkpoint = {"every_n_steps": 100, "save_top_k": 0, **sections.pop("checkpoint", {})}
    return tiny_recipe(directory, world, "gpt", trainer=trainer, checkpoint=checkpoint, **sections)


def guard_state(run_dir) -> dict:
    return read(run_dir / "checkpoints" / "last.ckpt")["callbacks"]["StepGuard"]


def test_nan_gradient_step_is_skipped_and_equals_a_run_without_that_update(tmp_path, tiny_world):
    guarded = recipe(tmp_path / "nan", tiny_world)
    reference = recipe(tmp_path / "undo", tiny_world)
    assert fit_with_faults("nan@3", ["fit", str(guarded)]) == 0
    assert fit_with_faults("undo@3", ["fit", str(reference)]) == 0
    a, b = (
        model_weights(tmp_path / "nan/run/checkpoints/last.ckpt"),
        model_weights(tmp_path / "undo/run/checkpoints/last.ckpt"),
    )
    for key in b:
        assert torch.equal(a[key], b[key]), key
    state = guard_state(tmp_path / "nan" / "run")
    # the fault's step 3 (steps completed before it) is the 4th: step 4 in the events and the logs
    assert state["nonfinite_steps"] == 1 and [e["step"] for e in state["events"]] == [4]
    logged = metric_by_step(read_metrics(tmp_path / "nan" / "run"), "guard/nonfinite_steps")
    assert logged == {4: 1.0}


SPIKE = {"snapshot_every": 4, "spike": {"enabled": True, "k": 3.0, "m": 2, "window": 20, "min_history": 4}}


def test_spike_rolls_back_skips_its_data_and_ends_near_the_clean_run(tmp_path, tiny_world):
    """The learning rate of steps 9-10 (fault steps 8-9) is multiplied by 300: the loss jumps from ~5.9 to ~15;
    at step 11 the guard rolls back to the snapshot after step 8, skips the samples read since, and the run ends
    close to the clean one."""
    common = {"trainer": {"max_steps": 20, "val_check_interval": 20}, "optim": {"decay_steps": 20}}
    clean = recipe(tmp_path / "clean", tiny_world, **common)
    guarded = recipe(tmp_path / "guarded", tiny_world, guards=SPIKE, **common)
    assert fit_with_faults("-", ["fit", str(clean)]) == 0
    assert fit_with_faults("lr@8-10:300", ["fit", str(guarded)]) == 0
    rows = {name: read_metrics(tmp_path / name / "run") for name in ("clean", "guarded")}
    train = metric_by_step(rows["guarded"], "train/loss")
    assert max(train.values()) > 2 * metric_by_step(rows["clean"], "train/loss")[10]  # the fault did hit
    (event,) = guard_state(tmp_path / "guarded" / "run")["events"]
    assert event["event"] == "rollback_spike" and event["to_step"] == 8 and event["step"] == 11
    batch = 4  # micro_batch_size x 1 rank: steps 9, 10 and 11 read the skipped samples
    assert event["skipped_samples"] == [(0, 8 * batch), (0, 11 * batch)]
    assert metric_by_step(rows["guarded"], "guard/rollback_to_step") == {11: 8.0}
    assert metric_by_step(rows["guarded"], "guard/skipped_from_sample") == {11: 32.0}
    val = {name: metric_by_step(rows[name], "val/loss")[20] for name in rows}
    assert abs(val["guarded"] - val["clean"]) < 0.15, val  # 3 steps of progress lost: ~0.1 at this point

    # a run stopped mid-spike (checkpoint at step 10, one anomalous step seen) and resumed decides the same
    resumed = recipe(tmp_path / "resumed", tiny_world, guards=SPIKE, **common)
    with pytest.raises(InjectedCrash):
        fit_with_faults("lr@8-10:300,crash@10", ["fit", str(resumed), "checkpoint.every_n_steps=10"])
    saved = guard_state(tmp_path / "resumed" / "run")
    assert saved["spike_streak"] == 1 and saved["snapshot"]["step"] == 8  # the rollback target travels along
    assert fit_with_faults("lr@8-10:300", ["fit", str(resumed)]) == 0
    assert guard_state(tmp_path / "resumed" / "run")["events"] == [event]
    a, b = (model_weights(tmp_path / name / "run/checkpoints/last.ckpt") for name in ("guarded", "resumed"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_enospc_during_a_save_keeps_the_previous_checkpoint(tmp_path, tiny_world, capsys):
    from pretrain.checkpoint import find_resume

    run_dir = tmp_path / "full" / "run"
    full = recipe(tmp_path / "full", tiny_world, checkpoint={"every_n_steps": 3, "save_top_k": 0})
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / ".last.ckpt.stale.tmp").write_bytes(b"\0" * 10)  # from a killed write
    assert fit_with_faults("enospc@5", ["fit", str(full)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "last.ckpt" in err[0], err
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # the stale one was freed, the new one removed
    assert find_resume(run_dir / "checkpoints") == run_dir / "checkpoints" / "last.ckpt"
    assert read(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert fit_with_faults("-", ["fit", str(full)]) == 0  # space is back: resume=auto continues from step 3
    assert read(run_dir / "checkpoints" / "last.ckpt")["global_step"] == STEPS


HANG = {"hang": {"factor": 5.0, "min_seconds": 2.0, "startup_seconds": 60.0}}
DDP = {"name": "ddp", "ddp": {"process_group_backend": "gloo"}}


def fault_script(spec: str, recipe_path, timeout: float = 300):
    return subprocess.run(
        [sys.executable, str(FAULT_RUN), spec, "fit", str(recipe_path)],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# one process in the heavy tier (~21 s): the 2-rank case runs the same watchdog and checks the sleeping rank's dump
# (on_train_batch_start, as a lone process's) besides the one blocked in the all-reduce
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.heavy), 2])
def test_hang_dumps_every_ranks_stacks_and_exits_nonzero(tmp_path, tiny_world, ranks):
    """Step 5 of the last rank sleeps 10 minutes: within the configured 2 s (5 x the median step), every rank
    writes its Python stacks -- the sleeping one, and the one blocked in the all-reduce waiting for it -- and
    the run exits with status 1, long before the sleep would end (the subprocess timeout is 5 minutes)."""
    ddp = {"strategy": DDP, "trainer": {"devices": 2}} if ranks == 2 else {}
    path = recipe(tmp_path / "hang", tiny_world, guards=HANG, **ddp)
    proc = fault_script(f"hang@5:{ranks - 1}", path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = tmp_path / "hang" / "run"
    dumps = {p.name: p.read_text() for p in run_dir.glob("hang-rank*.txt")}
    assert sorted(dumps) == [f"hang-rank{r}.txt" for r in range(ranks)]
    for name, text in dumps.items():
        assert text.startswith("Timeout (0:00:02)!"), text
        assert (
            "on_train_batch_start" in text if name.endswith(f"{ranks - 1}.txt") else "training_step" in text
        )
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()  # it never reached the end


def test_nan_on_one_of_two_ranks_is_skipped_on_both(tmp_path, tiny_world):
    """Rank 1's gradient of step 3 is NaN: both ranks skip the step (one all-reduced decision); the weights
    equal one process with the whole batch whose step-3 update is undone."""
    two = recipe(tmp_path / "two", tiny_world, strategy=DDP, trainer={"devices": 2})
    one = recipe(tmp_path / "one", tiny_world, data={"micro_batch_size": 8})
    proc = fault_script("nan@3:1", two)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert fit_with_faults("undo@3", ["fit", str(one)]) == 0
    a, b = (model_weights(tmp_path / name / "run/checkpoints/last.ckpt") for name in ("two", "one"))
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)  # reduction order
    state = guard_state(tmp_path / "two" / "run")
    assert state["nonfinite_steps"] == 1 and [e["step"] for e in state["events"]] == [4]
