"""Exact resume: SIGKILL at a random step + `resume=auto` ends bitwise equal to an uninterrupted run (dropout on);
a truncated newest checkpoint falls back to the previous one; the W&B run keeps its id across the restart."""

from __future__ import annotations

import copy
import json
import random
import signal
import time

import pytest
import torch
from training_utils import (
    Background,
    fit_and_kill,
    fit_and_signal,
    launch_losses,
    metric_by_step,
    model_weights,
    read_metrics,
    run_cli,
    tiny_recipe,
    wandb_records,
)

MAX_STEPS = 8


def resume_recipe(directory, world, kind: str, **sections):
    directory.mkdir()
    return tiny_recipe(
        directory,
        world,
        kind,
        model={"dropout": 0.1, **({"attn_dropout": 0.1} if kind == "bert" else {})},
        trainer={
            "max_steps": MAX_STEPS,
            "val_check_interval": MAX_STEPS // 2,  # the last step validates, whichever launch runs it
            "log_every_n_steps": 1,
            **sections.pop("trainer", {}),
        },
        checkpoint={"every_n_steps": 1, "save_top_k": 1, **sections.pop("checkpoint", {})},
        **sections,
    )


def assert_same_weights(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


def check_wandb(run_dir, killed_at: int) -> None:
    """Two launches -> two offline run directories with one run id; config and metrics recorded."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    ids = {f.stem.removeprefix("run-") for f in files}
    assert len(ids) == 1
    records = [wandb_records(f) for f in files]
    runs = [r.run for rs in records for r in rs if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == ids and {r.run_group for r in runs} == {"g"}
    config = {item.key: item.value_json for item in runs[-1].config.update}
    assert '"decoder"' in config["model"] and config["name"] == '"tiny-gpt"'  # the resolved config
    logged = [
        {(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
        for r in records[1]
        if r.WhichOneof("record_type") == "history"
    ]
    steps = sorted(int(h["trainer/global_step"]) for h in logged if "train/loss" in h)
    assert steps and steps[0] > killed_at and steps[-1] == MAX_STEPS  # the second launch continues
    # on the run's step axis: W&B's own step is the trainer's (before: W&B counted the second launch from 0)
    assert all(int(h["_step"]) == int(h["trainer/global_step"]) for h in logged if "trainer/global_step" in h)
    assert any("val/loss" in h for h in logged)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "accumulate", "optim"),
    [
        ("gpt", 1, "adamw"),
        pytest.param("bert", 2, "adamw", marks=pytest.mark.heavy),
        pytest.param("t5", 1, "adamw", marks=pytest.mark.heavy),
        ("gpt", 2, "muon"),
        ("gpt-tp2", 1, "adamw"),
        # ~100 worker-s; in make test a CP=2 checkpoint is resumed by test_reshard's CP=2 -> DDP cell
        pytest.param("gpt-cp2", 1, "adamw", marks=pytest.mark.heavy),
    ],
)
def test_sigkill_then_resume_auto_is_bitwise_exact(tmp_path, tiny_world, kind, accumulate, optim):
    """``gpt-tp2``: 2 gloo ranks of FSDP2 x tensor parallelism 2 (DCP shards of DTensors; dropout drawn per rank
    on the split activations, ``RankRandomness``). ``gpt-cp2``: 2 gloo ranks of FSDP2 (over dp_shard x cp) x
    context parallelism 2, every sequence split in the DataLoader's workers, packed-document masks, dropout drawn
    per context-parallel rank."""
    wandb = (
        {"logger": {"wandb": {"enabled": True, "group": "g"}}} if (kind, optim) == ("gpt", "adamw") else {}
    )
    sections = {
        "trainer": {"accumulate_grad_batches": accumulate},
        "optim": {"name": optim, "warmup_steps": 2},
    }
    if kind in ("gpt-tp2", "gpt-cp2"):
        parallel = "tensor_parallel" if kind == "gpt-tp2" else "context_parallel"
        kind = "gpt"
        sections["trainer"]["devices"] = 2
        sections["strategy"] = {"name": "fsdp", parallel: 2}
    full = resume_recipe(tmp_path / "full", tiny_world, kind, **copy.deepcopy(sections))
    reference = Background("fit", str(full), log=tmp_path / "full.log")  # runs alongside the killed one
    killed = resume_recipe(tmp_path / "killed", tiny_world, kind, **copy.deepcopy(sections), **wandb)
    step = fit_and_kill(
        killed, tmp_path / "killed" / "run", kill_at_step=random.Random(0).randint(2, MAX_STEPS - 3)
    )
    assert step < MAX_STEPS
    out = run_cli("fit", str(killed))  # resume=auto is the default
    assert f"steps: {MAX_STEPS}" in out.stdout
    reference.wait()
    assert_same_weights(
        model_weights(tmp_path / "full/run/checkpoints/last.ckpt"),
        model_weights(tmp_path / "killed/run/checkpoints/last.ckpt"),
    )
    # the resumed launch (the newest CSV) logged the uninterrupted run's losses from its checkpoint step on
    full_loss = metric_by_step(read_metrics(tmp_path / "full/run"), "train/loss")
    resumed = metric_by_step(read_metrics(tmp_path / "killed/run", newest_only=True), "train/loss")
    assert step < min(resumed) and max(resumed) == MAX_STEPS  # resumed, not restarted
    assert resumed == {s: full_loss[s] for s in resumed}
    if wandb:
        check_wandb(tmp_path / "killed" / "run", step)


def complete_records(run_file, timeout: float = 60) -> list:
    """The records of an offline run file once W&B has written its last one, the run's ``exit`` record: under
    load W&B's service may still be writing the file when ``wandb.finish()`` has returned (a CI run read the third
    launch's file without its history, which W&B's own end-of-run summary showed)."""
    from google.protobuf.message import DecodeError

    end = time.monotonic() + timeout
    while True:
        try:
            records = wandb_records(run_file)
        except DecodeError:  # a record cut mid-write: read again
            records = []
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > end:
            return records
        time.sleep(0.2)


def wandb_history(run_file) -> dict[int, dict]:
    """``{W&B step: row}`` of an offline run file (rows of one step merged, as W&B merges them)."""
    rows: dict[int, dict] = {}
    for record in complete_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): i.value_json for i in record.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def test_one_step_numbering_and_wandb_continues_the_runs_step_axis_never_logging_a_step_twice(
    tmp_path, tiny_world, capsys
):
    """Three launches of one W&B run (offline): 4 steps; a resume from the step-2 checkpoint, whose later steps
    the run holds already (W&B cannot rewind: they go to the CSV only, and a warning says so); 2 steps more.
    The k-th optimizer step is step k everywhere: W&B's step and ``trainer/global_step``, the CSV's ``step``,
    the progress lines and the checkpoint names (before: W&B and the CSV counted from 0, the others from 1)."""
    from pretrain.cli import main

    recipe = resume_recipe(
        tmp_path / "run",
        tiny_world,
        "gpt",
        trainer={"max_steps": 4, "val_check_interval": 2, "progress_bar": True, "progress_seconds": 1e-6},
        optim={"decay_steps": 6},
        checkpoint={"every_n_steps": 100, "save_top_k": -1},  # every validation's: after 2 and 4 updates
        logger={"wandb": {"enabled": True}},
    )
    run_dir = tmp_path / "run" / "run"
    capsys.readouterr()
    assert main(["fit", str(recipe)]) == 0
    progress = {  # "step 3/4 (75%) | loss 6.2150 | ...": one line per step (not a terminal)
        int(line.split()[1].split("/")[0]): line.split(" | ")[1].removeprefix("loss ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("step ")
    }
    first = read_metrics(run_dir)
    named = sorted(
        int(p.name.split("-")[1].removeprefix("step")) for p in (run_dir / "checkpoints").glob("best-*")
    )
    (older,) = (run_dir / "checkpoints").glob("best-step2-*.ckpt")
    with pytest.warns(
        UserWarning, match=r"holds steps up to 4 .*steps 3-4 of this launch are logged to the other"
    ):
        assert main(["fit", str(recipe), f"resume={older}"]) == 0
    assert main(["fit", str(recipe), "trainer.max_steps=6"]) == 0
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3 and len({f.name for f in files}) == 1  # one run id
    histories = [wandb_history(f) for f in files]
    trained = [sorted(s for s, row in h.items() if "train/loss" in row) for h in histories]
    # before: each launch's history from W&B step 0 ([0, 1, 2, 3], [0, 1], [0, 1]) and steps 2-3 sent twice
    assert trained == [[1, 2, 3, 4], [], [5, 6]]
    assert all(int(row["trainer/global_step"]) == s for h in histories for s, row in h.items())
    # the same step's numbers agree: progress line, CSV and W&B losses; validations and checkpoint names
    csv_loss = metric_by_step(first, "train/loss")
    assert sorted(progress) == sorted(csv_loss) == trained[0]
    assert all(progress[s] == f"{csv_loss[s]:.4f}" for s in progress)
    assert all(json.loads(histories[0][s]["train/loss"]) == pytest.approx(csv_loss[s]) for s in csv_loss)
    assert named == sorted(metric_by_step(first, "val/loss")) == [2, 4]
    validated = [int(row["step"]) for row in read_metrics(run_dir) if row.get("val/loss")]
    assert validated == [2, 4, 4, 6]  # the CSV has every launch's
    csv = metric_by_step(read_metrics(run_dir, newest_only=True), "train/loss")
    assert sorted(csv) == [5, 6] and csv[6] == pytest.approx(json.loads(histories[2][6]["train/loss"]))


def test_truncated_newest_checkpoints_fall_back_to_the_previous_valid_one(tmp_path, tiny_world):
    recipe = resume_recipe(
        tmp_path / "run",
        tiny_world,
        "gpt",
        trainer={"max_steps": 4, "val_check_interval": 2},
        checkpoint={"every_n_steps": 100, "save_top_k": 2},
    )
    run_cli("fit", str(recipe))
    checkpoints = tmp_path / "run/run/checkpoints"
    reference = model_weights(checkpoints / "last.ckpt")
    newest = [checkpoints / "last.ckpt", *checkpoints.glob("best-step4-*.ckpt")]
    assert len(newest) == 2 and len(list(checkpoints.glob("best-step2-*.ckpt"))) == 1
    for path in newest:  # a disk crash cut both checkpoints of step 4
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    out = run_cli("fit", str(recipe))
    assert "last.ckpt, which is truncated or corrupt" in out.stderr
    assert "steps: 4" in out.stdout
    assert_same_weights(reference, model_weights(checkpoints / "last.ckpt"))  # steps 3-4 redone identically


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.heavy)])
def test_extended_then_preempted_run_equals_one_uninterrupted_run(tmp_path, tiny_world, devices):
    """A finished 4-step run extended to 16 steps (its end-of-fit checkpoint is mid-epoch) continues the data;
    SIGTERM mid-way (to rank 0 only under DDP: the ranks agree) saves after the step, exits 143 with a resume
    hint, and `resume=auto` finishes. Every launch logs the uninterrupted run's losses; the weights end equal."""
    steps = 16
    ddp = {"strategy": {"name": "ddp", "ddp": {"process_group_backend": "gloo"}}} if devices > 1 else {}
    recipes = {
        name: resume_recipe(
            tmp_path / name,
            tiny_world,
            "gpt",
            optim={"decay_steps": steps},  # the schedule does not depend on the launch's max_steps
            trainer={"devices": devices, "max_steps": steps},
            checkpoint={"save_top_k": 0},
            **ddp,
        )
        for name in ("full", "resumed")
    }
    reference = Background("fit", str(recipes["full"]), log=tmp_path / "full.log")
    run_dir = tmp_path / "resumed" / "run"
    outputs = [run_cli("fit", str(recipes["resumed"]), "trainer.max_steps=4")]
    step, status, output = fit_and_signal(recipes["resumed"], run_dir, 6, signal.SIGTERM, whole_group=False)
    assert status == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM after step" in output and "continue with: pretrain fit" in output
    outputs.append(run_cli("fit", str(recipes["resumed"])))
    assert f"steps: {steps}" in outputs[-1].stdout
    reference.wait()
    full = launch_losses(tmp_path / "full" / "run")[0]
    launches = launch_losses(run_dir)
    assert [min(launch) for launch in launches] == [1, 5, max(launches[1]) + 1]  # each continues the last
    assert max(launches[1]) >= step  # saved after the step during which the signal arrived
    for launch in launches:
        assert launch == {s: full[s] for s in launch}
    assert sorted(s for launch in launches for s in launch) == list(range(1, steps + 1))
    assert_same_weights(
        model_weights(tmp_path / "full/run/checkpoints/last.ckpt"),
        model_weights(run_dir / "checkpoints/last.ckpt"),
    )
    assert not any("not resumable" in out.stderr for out in outputs) and "not resumable" not in output
