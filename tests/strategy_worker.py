"""One rank of the strategy matrix (``test_strategies.py``): trains each cell of a JSON list in turn, in the
process group that the test's launcher set up (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment), the
way ``pretrain fit`` trains. Writes ``<out>/<cell>.rank<r>.json``: weight-decayed tensors and FLOPs per batch.

    python tests/strategy_worker.py CELLS.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class RecordFlops(Callback):
    def __init__(self) -> None:
        self.flops: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.flops.append(pl_module.flops_per_batch)


def main(cells_json: str, out: str) -> None:
    from pretrain import config
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    for cell in json.loads(Path(cells_json).read_text()):
        run, resolved = config.load(cell["recipe"], cell["overrides"])
        parts = prepare_run(run, resolved)
        record = RecordFlops()
        module = parts["module"]
        trainer = build_trainer(run, resolved, callbacks=[record])
        trainer.fit(module, datamodule=parts["datamodule"])
        result = {"decayed": module.decayed_tensors, "flops": record.flops}
        Path(out, f"{cell['name']}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
