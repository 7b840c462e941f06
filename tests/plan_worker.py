"""One rank of ``test_plan.py``'s sharded check: two real training steps of a recipe under DDP and under FSDP2
(the project's ``shard_blocks``) on gloo, their per-rank peak by torch's memory tracker on real tensors, next
to ``pretrain plan``'s estimate for the same strategy. Writes ``OUT/rank<r>.json``.

    python tests/plan_worker.py RECIPE OUT [key=value ...]     (RANK, WORLD_SIZE, MASTER_* in the environment)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(recipe: str, out: str, overrides: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from pretrain import config
    from pretrain.training import plan
    from pretrain.training.memory_compat import trace_peak
    from pretrain.training.optim import build_optimizer
    from pretrain.training.strategies import shard_model

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    run, _ = config.load(recipe, overrides)
    B = run.data.micro_batch_size
    estimate = plan.trace(run, B, False)
    result = {}
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model, _ = plan.build(run, False)
        batch = plan.synthetic_batch(run, B)
        holder: dict = {}

        def step() -> None:
            if "optimizer" not in holder:  # wrapped inside the tracker: DDP's buckets are counted
                if strategy == "ddp":
                    holder["model"] = DistributedDataParallel(model)
                else:
                    shard_model(model, init_device_mesh("cpu", (world,)))
                    holder["model"] = model
                holder["optimizer"] = build_optimizer(model, run.optim)
            plan.train_step(holder["model"], holder["optimizer"], batch, run.trainer.precision)

        optimizer = torch.optim.AdamW(model.parameters())  # placeholder the tracker registers hooks on
        measured = trace_peak(model, optimizer, step, repeats=2)["total"]
        result[strategy] = {"measured": measured, "estimate": plan.per_gpu(estimate, strategy, world, run)["total"]}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
