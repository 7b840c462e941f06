"""``last.ckpt`` at optimizer-step boundaries, and graceful stops on SIGTERM, SIGUSR1 and SIGINT.

``LastCheckpoint`` writes ``last.ckpt`` in ``on_train_batch_end`` right after an optimizer step: every
``every_n_steps`` steps, at ``max_steps`` and when a stop signal has arrived. Every save therefore holds the
same loop state (a step just finished, its validation not yet run), so resuming a killed run, continuing a
preempted one and extending a finished one with a larger ``max_steps`` all continue exactly.

Stop signals (handlers installed when training starts, replacing Lightning's until the fit ends):

* SIGTERM (a scheduler's preemption, ``scancel``, ``kill``), SIGUSR1 (SLURM's ``--signal=USR1@SECONDS``
  before the time limit) and a first SIGINT (Ctrl-C) only record the request. At the next step boundary the
  ranks agree (one all-reduce of the signal number per step, before the update, read back with a
  ``DeferredRead`` once the step ends: a signal sent to one rank stops all) and save ``last.ckpt`` together; once that step is logged (and validated, if due), ``Trainer.fit`` raises ``Interrupted``.
  ``pretrain fit`` prints how to continue and exits with ``128 + signal number`` (143, 138, 130): the status
  of a process killed by that signal, not a success, so ``torchrun --max-restarts``, a restart policy or a
  wrapper script runs it again, and ``resume=auto`` continues.
* Under SLURM, SIGUSR1 also requeues the job (``scontrol requeue``, after the save): SLURM's time-limit
  warning means "continue later", while SIGTERM (``scancel``, preemption) leaves requeueing to SLURM.
* A second SIGINT raises ``KeyboardInterrupt`` at once (Lightning then stops without saving).

Lightning's own handlers are what this replaces: on SIGTERM it stops after the step without a checkpoint
and exits 0; its SLURM SIGUSR1 handler saves from inside the signal handler, mid-step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint

from pretrain.checkpoint.io import remove_partial_saves
from pretrain.compat.lightning import validation_follows
from pretrain.errors import InputError
from pretrain.training.callbacks.host_sync import DeferredRead, allowed

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Interrupted(Exception):
    """Raised out of ``Trainer.fit`` on every rank once ``path`` holds the state after ``step``."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; saved {path}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class LastCheckpoint(Checkpoint):
    """Saves ``path`` after every ``every_n_steps``-th optimizer step, after the last one, and after the step
    during which a stop signal arrived (then raises ``Interrupted`` before the next batch); removes stale
    partial saves at start. A step followed by a validation is saved after it (and after the best-k
    ``ModelCheckpoint``, listed before this callback), so the save holds that validation's best-k state. A
    ``Checkpoint``, so Lightning runs its hooks after the other callbacks' (whose state of the step is then in
    the save) and adds no default ``ModelCheckpoint``."""

    def __init__(self, path: str | Path, every_n_steps: int, signals: tuple[int, ...] = STOP_SIGNALS):
        if every_n_steps < 1:
            raise InputError(f"checkpoint.every_n_steps must be >= 1, got {every_n_steps}")
        self.path, self.every_n_steps, self.signals = Path(path), every_n_steps, tuple(signals)
        self.received: int | None = None  # the first stop signal this process got
        self._previous: dict[int, Any] = {}
        self._step = self._first_step = self._saved_step = -1
        self._announce = False
        self._stop: Interrupted | None = None
        self._pending = False  # a save due at this step, made once its validation has run
        self._agreed: DeferredRead | None = None  # the step's all-reduced signal number (0: none)

    # ----------------------------------------------------------------------------------------- signals
    def install(self) -> None:
        """Handle ``signals`` in this process (main thread only); a SIGINT ignored by the launching shell
        (``cmd &``) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if signum == signal.SIGINT and previous == signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self.handle)

    def restore(self) -> None:
        """The handlers from before ``install`` wherever ours is still the one installed."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self.handle:
                signal.signal(signum, previous)
        self._previous = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        again = ""
        if signum == signal.SIGINT:  # the next Ctrl-C interrupts at once, as Python's default does
            signal.signal(signal.SIGINT, signal.default_int_handler)
            again = " (Ctrl-C again stops at once, without saving)"
        if self._announce:
            name = signal.Signals(signum).name
            os.write(2, f"\n{name}: saving a checkpoint after this step, then stopping{again}\n".encode())

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            for path in remove_partial_saves(self.path.parent):
                log.info("removed %s, left by a checkpoint write that was killed", path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = self._first_step = trainer.global_step
        self._announce = trainer.is_global_zero
        self.install()  # after Lightning's signal connector registered its handlers

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self._agreed = self._agree(trainer)

    def _agree(self, trainer: L.Trainer) -> DeferredRead | None:
        """The largest signal number any rank received (0: none), on its way to the host; None on one rank."""
        if trainer.world_size == 1:
            return None
        signum = torch.tensor(self.received or 0, device=trainer.strategy.root_device)
        return DeferredRead(trainer.strategy.reduce(signum, reduce_op="max"))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step == self._step:  # a micro-batch within an accumulated step
            return
        self._step = step
        agreed, self._agreed = self._agreed or self._agree(trainer), None
        signum = int(agreed.read()) if agreed is not None else (self.received or 0)
        if signum or step % self.every_n_steps == 0 or step >= trainer.max_steps:
            if validation_follows(trainer):  # saved once this step's validation (and best-k update) has run
                self._pending = True
            else:
                self._save(trainer)
        if signum:  # raised when the next batch starts, once this step is logged (and validated, if due)
            self._stop = Interrupted(signum, step, self.path)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending and not trainer.sanity_checking:
            self._save(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self._pending:  # a validation that was due did not run
            self._save(trainer)
        if self._stop is not None:
            if self._stop.signum == signal.SIGUSR1 and trainer.is_global_zero:
                requeue_slurm_job()
            raise self._stop

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit stopped otherwise (``trainer.should_stop``) still leaves its final state."""
        if self._pending or trainer.global_step not in (self._first_step, self._saved_step):
            self._save(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.restore()

    def _save(self, trainer: L.Trainer) -> None:
        with allowed():  # every weight to the host
            trainer.save_checkpoint(self.path, weights_only=False)  # the full state, said (no notice)
        self._saved_step, self._pending = trainer.global_step, False


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (``--requeue``: it goes back to the queue; SLURM ends this run of
    it), as Lightning's SLURM auto-requeue does; nothing outside SLURM or in an interactive allocation."""
    job = SLURMEnvironment.job_id() if SLURMEnvironment.detect() else None
    if job is None:
        return
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else str(job)
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        log.warning("SLURM job %s not requeued: no scontrol on PATH", job_id)
        return
    if done.returncode:
        log.warning("scontrol requeue %s failed (%s): %s", job_id, done.returncode, done.stderr.strip())
    else:
        log.info("requeued SLURM job %s", job_id)
