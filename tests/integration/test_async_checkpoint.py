"""``checkpoint.async_save``: checkpoints written in the background as DCP directories, put in place atomically
once complete. One process here (in process, or a subprocess for the kill); DDP and FSDP2 on 2 gloo ranks are
in ``test_reshard.py``'s launch.

- a save still in flight when the fit ends, or when a stop signal ends it, is finished before the process exits;
- at most one save is in flight: a save starts only once the previous one is in place;
- the update after a save waits for the copy of its state (taken off the training thread), not for the write;
- SIGKILL while a write is in flight leaves the previous checkpoint, valid, and ``resume=auto`` continues from it
  exactly as an uninterrupted run (losses equal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from training_utils import REPO_ROOT, cli_env, launch_losses, metric_by_step, read_metrics, tiny_recipe

from pretrain.checkpoint import is_valid, kind
from pretrain.checkpoint.async_save import AsyncCheckpointWriter
from pretrain.checkpoint.resume import checkpoint_step
from pretrain.cli import main

STEPS = 8
KILL_WORKER = REPO_ROOT / "tests" / "integration" / "async_kill_worker.py"


def recipe(directory, world, **checkpoint):
    directory.mkdir(parents=True, exist_ok=True)
    return tiny_recipe(
        directory,
        world,
        "gpt",
        trainer={"max_steps": STEPS, "val_check_interval": 4},
        optim={"warmup_steps": 2, "decay_steps": STEPS},  # one schedule whatever max_steps a launch has
        checkpoint={"every_n_steps": 2, "save_top_k": 0, **checkpoint},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_world):
    """Losses of an uninterrupted run with synchronous saves."""
    path = recipe(tmp_path_factory.mktemp("async_reference"), tiny_world)
    assert main(["fit", str(path)]) == 0
    return metric_by_step(read_metrics(path.parent / "run"), "train/loss")


def leftovers(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("."))


@pytest.fixture
def slow_writes(monkeypatch):
    """Every background write takes 0.5 s longer; records how many were in flight at once and the steps put in
    place, in order."""
    record = {"in_flight": 0, "most": 0, "done": []}
    lock = threading.Lock()
    finish = AsyncCheckpointWriter._finish

    def slow_finish(upload, meta, tmp, path):
        with lock:
            record["in_flight"] += 1
            record["most"] = max(record["most"], record["in_flight"])
        time.sleep(0.5)
        finish(upload, meta, tmp, path)
        with lock:
            record["in_flight"] -= 1
            if meta is not None:
                record["done"].append(meta["global_step"])

    monkeypatch.setattr(AsyncCheckpointWriter, "_finish", staticmethod(slow_finish))
    return record


@pytest.mark.slow
def test_pending_save_is_finished_before_the_fit_returns_and_one_at_a_time(tmp_path, tiny_world, slow_writes):
    path = recipe(tmp_path, tiny_world, async_save=True, every_n_steps=1)
    assert main(["fit", str(path)]) == 0
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == STEPS and is_valid(last)  # the final save was still sleeping at the end
    assert slow_writes["done"] == list(range(1, STEPS + 1)) and slow_writes["most"] == 1
    assert leftovers(tmp_path / "run") == []


def test_the_update_after_a_save_waits_for_its_copy_and_the_write_puts_itself_in_place(tmp_path):
    """The save returns before its state is copied; the next optimizer step waits for the copy, so the checkpoint
    holds the weights of the save even though the update follows at once; the writer's thread puts it in place
    (``wait`` only joins it)."""
    import torch

    from pretrain.checkpoint import dcp

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    writer = AsyncCheckpointWriter()
    saved = model.weight.detach().clone()
    last = tmp_path / "last.ckpt"
    writer.save(
        {"state_dict": model.state_dict()},
        {"global_step": 1},
        last,
        distributed=False,
        optimizers=[optimizer],
    )
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.weight.detach(), saved)
    pending = writer._pending
    pending.result()  # the background write, not joined by the writer
    assert checkpoint_step(last) == 1 and is_valid(last)
    assert torch.equal(dcp.read(last)["state_dict"]["weight"], saved)
    writer.close()


def test_the_background_write_goes_around_the_page_cache(tmp_path, direct_io, resident_pages):
    """The checkpoint's files are written with O_DIRECT (``direct_write``): none of the 8 MiB of weights and
    moments is left in the page cache (a buffered write leaves it all, ``test_direct_write.py``), and they read
    back as saved."""
    import torch

    from pretrain.checkpoint import dcp
    from pretrain.checkpoint.optimizer_state import dcp_state

    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    optimizer.step()
    writer = AsyncCheckpointWriter(share=0.5)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    last = tmp_path / "last.ckpt"
    writer.save(dcp_state(checkpoint, [optimizer], model), {"global_step": 1}, last, distributed=False)
    writer.close()
    resident, pages = resident_pages(last / "__0_0.distcp")
    assert pages >= 3 * (4 << 20) // 4096 and resident < pages // 100, (resident, pages)
    assert torch.equal(dcp.read(last)["state_dict"]["weight"], model.weight.detach())


def test_a_full_disk_during_the_background_write_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    """ENOSPC inside DCP's save (which wraps each rank's error in a ``CheckpointException``) comes out of ``wait``
    as the one-line storage error; the partial directory is removed and ``last.ckpt`` still holds step 1."""
    import errno

    import torch

    from pretrain.checkpoint.io import CheckpointWriteError

    model = torch.nn.Linear(64, 64)
    writer = AsyncCheckpointWriter()
    last = tmp_path / "last.ckpt"
    writer.save({"state_dict": model.state_dict()}, {"global_step": 1}, last, distributed=False)
    writer.wait()

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    writer.save({"state_dict": model.state_dict()}, {"global_step": 2}, last, distributed=False)
    with pytest.raises(
        CheckpointWriteError,
        match=r"^could not write checkpoint .*last.ckpt \(in the background\): "
        r"No space left on device; the previous checkpoint is intact",
    ):
        writer.wait()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert checkpoint_step(last) == 1 and is_valid(last)
    writer.close()


def test_a_save_writes_the_guards_snapshot_of_its_state_instead_of_copying_it_again(tmp_path, monkeypatch):
    """At a checkpoint the guard's host snapshot of the same state is being copied anyway: the writer writes those
    copies (the very tensors, no staging copy of its own) and the checkpoint holds the state of the save although
    the update follows at once. A snapshot taken while that write still reads them gets fresh memory (the write's
    copies stay as they were); once the write is done the next snapshot re-uses its memory again."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.checkpoint

    from pretrain.checkpoint import dcp
    from pretrain.checkpoint.optimizer_state import dcp_state
    from pretrain.config.run import GuardsConfig
    from pretrain.training.callbacks.guards import StepGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        model(torch.randn(2, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # AdamW's moments exist
    trainer = SimpleNamespace(
        training=True,
        global_step=1,
        lightning_module=model,
        optimizers=[optimizer],
        strategy=None,
        datamodule=None,
    )
    guard = StepGuard(GuardsConfig())
    guard._trainer = trainer
    writer = AsyncCheckpointWriter()
    writer.host_copies = guard.host_copies
    staged = []
    stage = writer._stage
    writer._stage = lambda *args: staged.append(stage(*args)) or staged[-1]
    release = threading.Event()  # the write waits for it
    save = torch.distributed.checkpoint.save
    monkeypatch.setattr(
        torch.distributed.checkpoint, "save", lambda *a, **k: (release.wait(60), save(*a, **k))
    )

    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    guard._take_snapshot(trainer)  # what the guard's state_dict does at a checkpoint
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    writer.save(
        dcp_state(checkpoint, [optimizer], model),
        {"global_step": 1},
        tmp_path / "last.ckpt",
        distributed=False,
        optimizers=[optimizer],
    )
    step()  # waits for both copies
    guard._settle()
    snapshot = guard.snapshot
    copies = {id(t) for t in snapshot["model"].values()}
    copies |= {id(t) for s in snapshot["optimizers"][0]["state"].values() for t in s.values()}
    written = [dcp.get_path(staged[0], path) for path in dcp.flatten(staged[0]).values()]
    written = [t for t in written if isinstance(t, torch.Tensor)]
    assert writer._stager is None  # nothing staged by the writer itself
    assert len(written) == 4 + 3 * 4 and {id(t) for t in written} <= copies

    trainer.global_step = 2  # a snapshot while the write still reads the last one's memory
    guard._take_snapshot(trainer)
    guard._settle()
    assert not {id(t) for t in guard.snapshot["model"].values()} & copies
    release.set()
    writer.wait()
    state = dcp.read(tmp_path / "last.ckpt")
    for key, value in saved.items():
        assert torch.equal(state["state_dict"][key], value), key
    read_moments = [s["exp_avg"] for s in state["optimizer_0"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(read_moments, moments, strict=True))
    kept = {id(t) for t in guard.snapshot["model"].values()}
    trainer.global_step = 3
    guard._take_snapshot(trainer)
    guard._settle()
    assert {id(t) for t in guard.snapshot["model"].values()} == kept  # re-used once the write is done
    writer.close()


def start_worker(path, run_dir, *args):
    log = open(run_dir.parent / "worker.log", "w")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(
        [sys.executable, str(KILL_WORKER), str(run_dir), *args, "fit", str(path)],
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(marker, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, (marker.parent.parent / "worker.log").read_text()
        assert time.monotonic() < deadline, "the worker never reached the blocked write"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path, tiny_world, reference):
    """The write of step 4 stops half-way (after some of its tensors, in the writer thread) while training goes on;
    SIGKILL then: ``last.ckpt`` still holds step 2, valid; ``resume=auto`` removes the partial write and the
    resumed run ends as the uninterrupted one."""
    path = recipe(tmp_path, tiny_world, async_save=True)
    run_dir = tmp_path / "run"
    proc = start_worker(path, run_dir, "block-write-of-step", "4")
    try:
        wait_for(run_dir / "blocked", proc)
        # step 4's write started only once step 2's was in place (by the writer's thread, whatever the training
        # thread is doing): no waiting for it here
        last = run_dir / "checkpoints" / "last.ckpt"
        assert checkpoint_step(last) == 2
        time.sleep(0.5)  # training goes on meanwhile (the write is off its thread)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert kind(last) == "dcp" and is_valid(last) and checkpoint_step(last) == 2
    partial = leftovers(run_dir)
    assert len(partial) == 1 and partial[0].startswith(".last.ckpt.") and partial[0].endswith(".tmp")
    assert main(["fit", str(path)]) == 0  # resume=auto
    assert leftovers(run_dir) == [] and checkpoint_step(last) == STEPS
    resumed = launch_losses(run_dir)[-1]
    assert min(resumed) == 3 and resumed == pytest.approx({s: reference[s] for s in resumed}, rel=1e-6)


@pytest.mark.slow
def test_sigterm_finishes_the_pending_save_before_exit(tmp_path, tiny_world):
    """A stop signal saves the step it arrived in; that save is written in the background and the process exits
    (143) only once it is in place."""
    path = recipe(tmp_path, tiny_world, async_save=True, every_n_steps=100)
    run_dir = tmp_path / "run"
    proc = start_worker(path, run_dir, "slow-writes", "2", "signal-at-step", "3")
    assert proc.wait(300) == 128 + signal.SIGTERM, (tmp_path / "worker.log").read_text()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert is_valid(last) and checkpoint_step(last) == 3 and leftovers(run_dir) == []


def test_a_file_system_that_cannot_exchange_names_atomically_is_refused_in_one_line(
    tmp_path, tiny_world, capsys, monkeypatch
):
    """Without ``renameat2(RENAME_EXCHANGE)`` (NFS, most FUSE mounts) ``last.ckpt`` would be missing for a moment
    at every save: refused before training, nothing written."""
    from training_utils import one_error_line

    from pretrain.io import exchanges_atomically

    assert exchanges_atomically(tmp_path / "probe")  # this test's own file system can
    storage = sys.modules[exchanges_atomically.__module__]
    monkeypatch.setattr(storage, "_rename_exchange", lambda src, dst: False)
    path = recipe(tmp_path, tiny_world)
    line = one_error_line(capsys, "fit", path, "checkpoint.async_save=true")
    assert "checkpoint.async_save=true needs a file system that swaps two names atomically" in line
    assert "checkpoint.async_save=false" in line
    assert not list((path.parent / "run" / "checkpoints").iterdir())
