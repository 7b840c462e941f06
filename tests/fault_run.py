"""``pretrain fit`` with injected faults, for the fault-injection tests (run in-process or as a script, which
Lightning's DDP launcher re-runs for every rank):

    python tests/fault_run.py FAULTS fit RECIPE [key=value ...]

``FAULTS`` is a comma-separated list (``-`` for none) of (STEP: the steps completed before it, ``trainer.global_step``
while it runs; the logs, checkpoint names and guard events call it step STEP + 1)
    nan@STEP[:RANK]     the gradient of step STEP is NaN (on RANK only; default every rank)
    lr@A-B:FACTOR       the learning rate of steps A..B-1 is multiplied by FACTOR (a spike)
    hang@STEP[:RANK]    step STEP sleeps for 10 minutes
    crash@STEP          step STEP raises (after the checkpoints of the steps before it)
    enospc@STEP         from step STEP on, every checkpoint write fails with ENOSPC after writing some bytes
    undo@STEP           the reference: weights and optimizer state are put back after step STEP's update
"""

from __future__ import annotations

import copy
import errno
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REAL_SAVE = torch.save


class InjectedCrash(RuntimeError):
    pass


def parse(spec: str) -> list[tuple[str, str]]:
    return [tuple(item.split("@", 1)) for item in spec.split(",") if item and item != "-"]


class FaultInjector(Callback):
    def __init__(self, faults: list[tuple[str, str]]):
        self.faults = faults
        self.saved: dict[str, Any] | None = None
        self.hooks: list[Any] = []

    @staticmethod
    def _at(arg: str, trainer) -> bool:
        step, _, rank = arg.partition(":")
        return trainer.global_step == int(step) and (not rank or trainer.global_rank == int(rank))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches:
            return
        for kind, arg in self.faults:
            if kind == "nan" and self._at(arg, trainer):
                param = next(pl_module.parameters())
                self.hooks.append(param.register_hook(lambda g: torch.full_like(g, float("nan"))))
            elif kind == "lr":
                steps, factor = arg.split(":")
                start, end = map(int, steps.split("-"))
                if start <= trainer.global_step < end:
                    for group in trainer.optimizers[0].param_groups:
                        group["lr"] *= float(factor)
            elif kind == "hang" and self._at(arg, trainer):
                time.sleep(600)
            elif kind == "crash" and self._at(arg, trainer):
                raise InjectedCrash(f"injected crash at step {arg}")
            elif kind == "enospc" and trainer.global_step >= int(arg):
                fail_checkpoint_writes()
            elif kind == "undo" and self._at(arg, trainer):
                self.saved = {
                    "model": copy.deepcopy(pl_module.state_dict()),
                    "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
                }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.saved is not None:
            pl_module.load_state_dict(self.saved["model"])
            optimizer = trainer.optimizers[0]
            lrs = [group["lr"] for group in optimizer.param_groups]  # the scheduler has stepped already
            optimizer.load_state_dict(self.saved["optimizer"])
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            self.saved = None


def fail_checkpoint_writes() -> None:
    """``torch.save`` to a file writes 1 kB, then raises ENOSPC (a disk that fills during a save)."""
    if getattr(torch.save, "fails", False):
        return
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if hasattr(f, "write"):
            f.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    save.fails = True
    torch.save = save


def main(spec: str, argv: list[str]) -> int:
    import pretrain.training.trainer as trainer_module
    from pretrain.cli import main as cli_main

    build_guards = trainer_module.build_guards
    injector = FaultInjector(parse(spec))
    trainer_module.build_guards = lambda run: [*build_guards(run), injector]
    try:
        return cli_main(argv)
    finally:
        trainer_module.build_guards = build_guards
        torch.save = REAL_SAVE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
