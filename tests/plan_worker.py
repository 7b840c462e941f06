"""One rank of ``test_plan.py``'s sharded check: two real training steps of a recipe under DDP and under FSDP2
(``plan.shard``, as training shards) on gloo, their per-rank peak by torch's memory tracker on real tensors, next
to ``pretrain plan``'s estimate for the same strategy. Writes ``OUT/rank<r>.json``.

    python tests/plan_worker.py RECIPE OUT [key=value ...]     (RANK, WORLD_SIZE, MASTER_* in the environment)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def measure(run, strategy: str, world: int) -> int:
    """Per-rank peak of two real training steps under ``strategy``; the wrapping (and DDP's bucket allocation)
    happens inside the tracker so it is counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from pretrain.training import plan
    from pretrain.training.memory_compat import trace_peak
    from pretrain.training.optim import build_optimizer

    torch.manual_seed(0)
    model = plan.build(run, False)[0]
    # the tracker registers its optimizer hooks globally; this optimizer must not keep the unsharded parameters
    placeholder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    batch = plan.synthetic_batch(run, run.data.micro_batch_size)
    wrapped: dict = {}

    def step() -> None:
        if not wrapped:
            if strategy == "ddp":
                wrapped["model"] = DistributedDataParallel(model)
            else:
                plan.shard(model, run, init_device_mesh("cpu", (world,)))
                wrapped["model"] = model
            wrapped["optimizer"] = build_optimizer(model, run.optim)
        plan.train_step(wrapped["model"], wrapped["optimizer"], batch, run.trainer.precision)

    return trace_peak(model, placeholder, step, repeats=2)["total"]


def main(recipe: str, out: str, overrides: list[str]) -> None:
    from pretrain import config
    from pretrain.training import plan

    world = int(os.environ["WORLD_SIZE"])
    run, _ = config.load(recipe, overrides)
    B = run.data.micro_batch_size
    single, sharded = plan.trace(run, B, False), plan.trace(run, B, False, world)  # before the real group
    dist.init_process_group("gloo")
    result = {
        strategy: {
            "measured": measure(run, strategy, world),
            "estimate": plan.per_gpu(single, strategy, world, run, sharded)["total"],
        }
        for strategy in ("ddp", "fsdp")
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
