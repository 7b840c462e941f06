"""``pretrain fit`` with its background checkpoint writes held up, for ``test_async_checkpoint.py``:

    python async_kill_worker.py RUN_DIR [block-write-of-step N] [slow-writes SECONDS] [signal-at-step N] fit ...

``block-write-of-step N``: the write of step N's checkpoint stops after its third tensor (in the writer thread),
touches ``RUN_DIR/blocked`` and waits forever (the test kills the process); the previous checkpoint is then
already in place (a save starts only once the previous one is). ``slow-writes S``: every write
takes S seconds longer before it is put in place. ``signal-at-step N``: SIGTERM to this process at the end of
step N (as a scheduler's preemption would send).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_filesystem

from pretrain.checkpoint.async_save import AsyncCheckpointWriter
from pretrain.cli import main
from pretrain.training.callbacks.preemption import LastCheckpoint


def block_write_of_step(run_dir: Path, step: int) -> None:
    saving = {"step": -1, "items": 0}
    save, write_item = AsyncCheckpointWriter.save, dcp_filesystem._write_item

    def recording_save(self, tensors, meta, path, **kwargs):
        # the previous write may still be in flight (a loaded machine): ``save`` first waits for it, so do that
        # before the items counted become this step's; counting from the call blocked the previous write instead
        self.wait()
        saving["step"], saving["items"] = int(meta["global_step"]), 0
        return save(self, tensors, meta, path, **kwargs)

    def blocking_write_item(*args, **kwargs):
        result = write_item(*args, **kwargs)
        saving["items"] += 1
        if saving["step"] == step and saving["items"] == 3:
            (run_dir / "blocked").touch()
            threading.Event().wait()
        return result

    AsyncCheckpointWriter.save = recording_save
    dcp_filesystem._write_item = blocking_write_item


def slow_writes(seconds: float) -> None:
    finish = AsyncCheckpointWriter._finish

    def slow_finish(*args):
        time.sleep(seconds)
        finish(*args)

    AsyncCheckpointWriter._finish = staticmethod(slow_finish)


def signal_at_step(step: int) -> None:
    batch_end = LastCheckpoint.on_train_batch_end

    def signalling(self, trainer, *args):
        if trainer.global_step == step and self.received is None:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch_end(self, trainer, *args)

    LastCheckpoint.on_train_batch_end = signalling


if __name__ == "__main__":
    run_dir, args = Path(sys.argv[1]), sys.argv[2:]
    while args[0] != "fit":
        option, value, args = args[0], args[1], args[2:]
        if option == "block-write-of-step":
            block_write_of_step(run_dir, int(value))
        elif option == "slow-writes":
            slow_writes(float(value))
        elif option == "signal-at-step":
            signal_at_step(int(value))
    sys.exit(main(args))
