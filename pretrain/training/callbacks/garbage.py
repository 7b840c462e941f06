"""Python's cyclic garbage collector on the step schedule (``trainer.gc_every_n_steps``), as torchtitan's
``GarbageCollection`` (``training.gc_freq``): automatic collection off while fit runs, and a young-generation
collection (``gc.collect(1)``: the objects made since the last one, never a scan of everything torch and Lightning
hold, ~120 ms for their ~350k objects) every N optimizer steps -- on the same step on every rank, so no rank
stalls the others' next collective with a collection of its own -- and after each validation. Cycles that reach
the oldest generation wait for Python's own collector after fit, as in torchtitan. Python's GC state before fit is
back after it (also after an exception): fit runs in-process in tests and notebooks."""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from pretrain.training.step import ends_step


class ScheduledGarbageCollection(Callback):
    """Automatic GC off from train start to teardown; ``gc.collect(1)`` after every ``every_n_steps``-th step."""

    def __init__(self, every_n_steps: int):
        self.every_n_steps = every_n_steps
        self._was_enabled: bool | None = None  # Python's setting before fit; None outside fit

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(1)  # the set-up's young garbage

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if ends_step(idx, trainer.accumulate_grad_batches) and trainer.global_step % self.every_n_steps == 0:
            gc.collect(1)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._was_enabled is not None:
            gc.collect(1)

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
