"""One rank of ``test_plan.py``'s sharded check: two real training steps of a recipe on gloo under DDP, FSDP2
(``plan.shard``, as training shards) and DeepSpeed ZeRO-1/2/3 (``deepspeed.initialize`` with the run's
``deepspeed_config``, as Lightning's strategy calls it), their per-rank peak by torch's memory tracker on real
tensors (the wrapping counted in what is live, not its own transient peak: as the GPU check resets the CUDA
peak at the start of training), next to ``pretrain plan``'s estimate for the same strategy. Writes
``OUT/rank<r>.json``; rank 0 prints the table.

    torchrun --nproc-per-node 2 tests/plan_worker.py RECIPE OUT [key=value ...]
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")


def measure(run, strategy: str, world: int) -> int:
    """Per-rank peak of two real training steps of ``run`` under ``strategy``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from pretrain.compat.memory import trace_peak
    from pretrain.objectives.loss import token_cross_entropy
    from pretrain.optim import build_optimizer
    from pretrain.training import plan
    from pretrain.training.strategies import deepspeed_config

    torch.manual_seed(0)
    model = plan.build(run, run.trainer.activation_checkpointing)[0]
    # the tracker registers its optimizer hooks globally; this optimizer must not keep the unsharded parameters
    placeholder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    batch = plan.synthetic_batch(run, run.data.micro_batch_size)
    wrapped: dict = {}

    def setup() -> None:
        if strategy == "ddp":
            wrapped["model"] = DistributedDataParallel(model)
        elif strategy == "fsdp":
            plan.shard(model, run, init_device_mesh("cpu", (world,)))
            wrapped["model"] = model
        else:
            import deepspeed

            config = {**deepspeed_config(run), "gradient_clipping": run.trainer.gradient_clip_val}
            if run.trainer.precision == "bf16-mixed":
                config["bf16"] = {"enabled": True}  # as Lightning's DeepSpeed precision plugin configures it
            trainable = [p for p in model.parameters() if p.requires_grad]
            wrapped["engine"], *_ = deepspeed.initialize(
                model=model,
                optimizer=build_optimizer(model, run.optim),
                config=config,
                model_parameters=trainable,
            )
            return
        wrapped["optimizer"] = build_optimizer(model, run.optim)

    def step() -> None:
        if "engine" not in wrapped:
            return plan.train_step(wrapped["model"], wrapped["optimizer"], batch, run.trainer.precision)
        engine = wrapped["engine"]
        loss = token_cross_entropy(engine(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                   batch["labels"])[0]  # fmt: skip
        engine.backward(loss)
        engine.step()

    return trace_peak(model, placeholder, step, setup=setup)["total"]


def main(recipe: str, out: str, overrides: list[str]) -> None:
    from pretrain import config
    from pretrain.training import plan

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    world = int(os.environ["WORLD_SIZE"])
    run, _ = config.load(recipe, overrides)
    B = run.data.micro_batch_size
    traces = plan.traces(
        run, B, run.trainer.activation_checkpointing, world
    )  # before the real group: FSDP's is traced on a fake one
    dist.init_process_group("gloo")
    result = {}
    for strategy in STRATEGIES:
        cell = run
        if strategy.startswith("zero"):
            ds = replace(run.strategy.deepspeed, stage=int(strategy[4]))
            cell = replace(run, strategy=replace(run.strategy, name="deepspeed", deepspeed=ds))
        result[strategy] = {
            "measured": measure(cell, strategy, world),
            "estimate": plan.per_gpu(traces, strategy, world, cell)["total"],
        }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    if dist.get_rank() == 0:
        for strategy, row in result.items():
            error = row["estimate"] / row["measured"] - 1
            print(f"{strategy:<6} estimate {row['estimate'] / 1e6:8.3f} MB  measured {row['measured'] / 1e6:8.3f} MB"
                  f"  {error:+.1%}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
