"""LastCheckpoint in process: a stop signal saves at the next step boundary and stops before the next batch; a
second Ctrl-C stops at once; stale partial saves go; Lightning's signal handlers come back after the fit.
(SIGTERM mid-run through the CLI, 1 and 2 ranks, resumed exactly: tests/integration/test_resume.py.)"""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from pretrain.checkpoint import read
from pretrain.training.callbacks.preemption import Interrupted, LastCheckpoint


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler, as an interactive shell gives it: a background job (``make test &``, nohup)
    inherits SIGINT ignored, which ``LastCheckpoint.install`` then leaves ignored on purpose."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Signaller(L.LightningModule):
    """A linear model that sends itself ``signals`` during the training step of optimizer step ``at``."""

    def __init__(self, at: int, signals: tuple[int, ...]):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.at, self.signals, self.steps_run = at, signals, []

    def training_step(self, batch, batch_idx):
        self.steps_run.append(self.global_step)
        if self.global_step == self.at:
            for signum in self.signals:
                os.kill(os.getpid(), signum)
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, module: Signaller, accumulate: int = 1) -> LastCheckpoint:
    callback = LastCheckpoint(tmp_path / "ckpt" / "last.ckpt", every_n_steps=100)
    trainer = L.Trainer(
        max_steps=10,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(torch.randn(64, 4), batch_size=2))
    return callback


@pytest.mark.parametrize(
    ("signum", "accumulate"), [(signal.SIGUSR1, 1), (signal.SIGTERM, 2), (signal.SIGINT, 1)]
)
def test_a_stop_signal_saves_after_the_step_and_stops_before_the_next(tmp_path, signum, accumulate):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    (tmp_path / "ckpt").mkdir()
    stale = tmp_path / "ckpt" / ".last.ckpt.k1ll3d.tmp"  # what a write killed mid-save leaves
    stale.write_bytes(b"partial")
    module = Signaller(at=2, signals=(signum,))  # arrives in the first micro-batch of optimizer step 3
    with pytest.raises(Interrupted) as stop:
        fit(tmp_path, module, accumulate)
    assert stop.value.signum == signum and stop.value.exit_status == 128 + signum
    assert stop.value.step == 3 and read(stop.value.path)["global_step"] == 3  # the step it arrived in ended
    assert max(module.steps_run) == 2  # no micro-batch of step 4 ran
    assert not stale.exists()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    module = Signaller(at=2, signals=(signal.SIGINT, signal.SIGINT))
    with pytest.raises(SystemExit):  # Lightning's KeyboardInterrupt handling exits 1
        fit(tmp_path, module)
    assert module.steps_run == [0, 1, 2] and not (tmp_path / "ckpt" / "last.ckpt").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_runs_end_with_their_final_state_saved_whatever_the_interval(tmp_path):
    fit(tmp_path, Signaller(at=-1, signals=()))
    assert read(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 10


def test_sigusr1_under_slurm_requeues_the_job_once_saved(tmp_path, monkeypatch):
    """SLURM's ``--signal=USR1@T`` before the time limit: save, then ``scontrol requeue <job id>``."""
    calls = tmp_path / "scontrol.calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    last = tmp_path / "ckpt" / "last.ckpt"
    fake.write_text(f'#!/bin/sh\necho "$@ saved=$(test -f {last} && echo yes)" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    slurm = {"NTASKS": 1, "NTASKS_PER_NODE": 1, "NNODES": 1, "PROCID": 0, "LOCALID": 0, "NODEID": 0}
    for key, value in {**slurm, "JOB_ID": 4242, "JOB_NAME": "pretrain"}.items():
        monkeypatch.setenv(f"SLURM_{key}", str(value))
    with pytest.raises(Interrupted):
        fit(tmp_path, Signaller(at=1, signals=(signal.SIGUSR1,)))
    assert calls.read_text() == "requeue 4242 saved=yes\n"
