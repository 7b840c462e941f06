"""One rank of several ``pretrain fit`` runs with ``ema.decay`` set (``test_ema.py``), separated by ``+`` as in
``fit_worker.py``, counting the collectives each EMA update issues: every collective of ``torch.distributed`` and
``deepspeed.comm`` is wrapped with a counter, and ``<run_dir>/collectives.rank<r>.json`` gets
``{"in_ema_updates": n, "in_training": m}`` (m: all others, so a counter that sees nothing fails the test).

    python tests/ema_worker.py fit RECIPE [key=value ...] [+ fit RECIPE2 ...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch.distributed as dist

from pretrain.cli import main
from pretrain.training.callbacks.ema import EMA

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
)  # fmt: skip
counts = {"in_ema_updates": 0, "in_training": 0}
inside = [False]


def counting(module, name):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts["in_ema_updates" if inside[0] else "in_training"] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def patch() -> None:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as strategies.build_deepspeed sets it
    import deepspeed.comm as ds_comm

    for module in (dist, ds_comm):
        for name in COLLECTIVES:
            if hasattr(module, name):
                counting(module, name)
    update, end = EMA.on_train_batch_end, EMA.teardown

    def counted_update(self, *args, **kwargs):
        inside[0] = True
        try:
            return update(self, *args, **kwargs)
        finally:
            inside[0] = False

    def write_counts(self, trainer, *args, **kwargs):
        out = Path(trainer.default_root_dir) / f"collectives.rank{trainer.global_rank}.json"
        out.write_text(json.dumps(counts))
        counts.update(dict.fromkeys(counts, 0))
        return end(self, trainer, *args, **kwargs)

    EMA.on_train_batch_end, EMA.teardown = counted_update, write_counts


if __name__ == "__main__":
    patch()
    args = sys.argv[1:]
    commands = [list(group) for plus, group in itertools.groupby(args, lambda a: a == "+") if not plus]
    for command in commands:
        if status := main(command):
            sys.exit(status)
