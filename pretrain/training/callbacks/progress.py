"""What a run shows while it trains: Lightning's progress bar on a terminal, and one line every
``trainer.progress_seconds`` seconds (and at the last step) where the output is a log file, CI or SLURM, which a
bar would fill with control characters or leave empty."""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback

from pretrain.training.callbacks.host_sync import allowed


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class ProgressLog(Callback):
    """``step 120/300 (40%) | loss 3.2104 | 1m05s elapsed, eta 1m38s``, on rank zero, at most once every
    ``every_seconds`` seconds of training, and at the last step."""

    def __init__(self, every_seconds: float, stream: Any = None):
        self.every_seconds, self.stream = every_seconds, stream
        self._start = self._last = 0.0
        self._first_step = self._step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = self._last = time.monotonic()
        self._first_step = self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step, now = trainer.global_step, time.monotonic()
        if step == self._step or not trainer.is_global_zero:  # a micro-batch within an accumulated step
            return
        self._step = step
        last = step >= trainer.max_steps
        if now - self._last < self.every_seconds and not last:
            return
        self._last = now
        elapsed, done = now - self._start, step - self._first_step
        parts = [f"step {step}/{trainer.max_steps} ({100 * step // max(trainer.max_steps, 1)}%)"]
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            with allowed():  # a host tensor: PretrainModule logs its metrics on the host
                parts.append(f"loss {float(loss):.4f}")
        eta = elapsed / done * (trainer.max_steps - step) if done else 0.0
        parts.append(f"{duration(elapsed)} elapsed" + ("" if last else f", eta {duration(eta)}"))
        print(" | ".join(parts), file=self.stream or sys.stdout, flush=True)


def progress_callbacks(enabled: bool, every_seconds: float) -> tuple[list[Callback], bool]:
    """``(callbacks, enable_progress_bar)``: the step-counting bar on a terminal, else the periodic line."""
    if not enabled:
        return [], False
    if sys.stdout.isatty():
        from pretrain.compat.lightning import StepProgressBar

        return [StepProgressBar()], True
    return [ProgressLog(every_seconds)], False
