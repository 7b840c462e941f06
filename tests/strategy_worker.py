"""One rank of the strategy matrix (``test_strategies.py``, ``test_tensor_parallel.py``): trains each cell of a
JSON list in turn, in the process group that the test's launcher set up (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*
in the environment), the way ``pretrain fit`` trains. Writes ``<out>/<cell>.rank<r>.json``: weight-decayed tensors
and FLOPs per batch; for a cell with ``"record": true`` also ``<out>/<cell>.pt`` (rank 0): the whole gradients
before the first optimizer step and the whole weights after training, by parameter name.

    python tests/strategy_worker.py CELLS.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective: every rank calls it), or the tensor itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class RecordFlops(Callback):
    def __init__(self) -> None:
        self.flops: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.flops.append(pl_module.flops_per_batch)


class RecordTensors(Callback):
    """The whole gradients before the first optimizer step and the whole weights at the end of training."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: whole(p.grad) for n, p in pl_module.model.named_parameters()}

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = {n: whole(p) for n, p in pl_module.model.named_parameters()}


def main(cells_json: str, out: str) -> None:
    from pretrain import config
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    for cell in json.loads(Path(cells_json).read_text()):
        run, resolved = config.load(cell["recipe"], cell["overrides"])
        parts = prepare_run(run, resolved)
        record, tensors = RecordFlops(), RecordTensors()
        module = parts.module
        trainer = build_trainer(
            run, resolved, callbacks=[record, tensors] if cell.get("record") else [record]
        )
        trainer.fit(module, datamodule=parts.datamodule)
        result = {"decayed": module.decayed_tensors, "flops": record.flops}
        Path(out, f"{cell['name']}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
        if cell.get("record") and trainer.global_rank == 0:
            torch.save({"grads": tensors.grads, "weights": tensors.weights}, Path(out, f"{cell['name']}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
