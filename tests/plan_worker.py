"""One rank of ``test_plan.py``'s sharded check: two real training steps of a recipe on gloo under DDP, FSDP2
(``plan.shard``, as training shards), FSDP2 with tensor parallelism 2 and with context parallelism 2 (the run's
``parallelize`` on its mesh, ``plan.shard``) and DeepSpeed ZeRO-1/2/3 (``deepspeed.initialize`` with the run's
``deepspeed_config``, as Lightning's strategy calls it), their per-rank peak by torch's memory tracker on real
tensors (the wrapping counted in what is live, not its own transient peak: as the GPU check resets the CUDA
peak at the start of training), next to ``pretrain plan``'s estimate for the same strategy. Writes
``OUT/rank<r>.json``; rank 0 prints the table. The TP / CP rows' estimates are traced by the test itself
(:func:`layout_estimate`).

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

STRATEGIES = ("ddp", "fsdp", "fsdp+tp2", "fsdp+cp2", "zero1", "zero2", "zero3")
LAYOUTS = {"fsdp+tp2": (2, 1), "fsdp+cp2": (1, 2)}  # (tensor_parallel, context_parallel)


def measure(run, strategy: str, world: int) -> int:
    """Per-rank peak of two real training steps of ``run`` under ``strategy``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from pretrain.compat.memory import trace_peak
    from pretrain.objectives.loss import token_cross_entropy
    from pretrain.optim import build_optimizer
    from pretrain.parallel.mesh import ParallelDims
    from pretrain.training import plan
    from pretrain.training.strategies import deepspeed_config

    torch.manual_seed(0)
    model = plan.build(run, run.trainer.activation_checkpointing)[0]
    # the tracker registers its optimizer hooks globally; this optimizer must not keep the unsharded parameters
    placeholder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    tp, cp = LAYOUTS.get(strategy, (1, 1))
    # a context-parallel rank's positions (rank 0's: every rank's have its shapes)
    batch = plan.synthetic_batch(run, run.data.micro_batch_size, cp)
    wrapped: dict = {}

    def setup() -> None:
        if strategy == "ddp":
            wrapped["model"] = DistributedDataParallel(model)
        elif strategy == "fsdp":
            plan.shard(model, run, init_device_mesh("cpu", (world,)))
            wrapped["model"] = model
        elif strategy in LAYOUTS:
            plan.shard(model, run, ParallelDims(1, world // (tp * cp), cp, tp).build("cpu"))
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
            return plan.train_step(
                wrapped["model"], wrapped["optimizer"], batch, run.trainer.precision, tp > 1
            )
        engine = wrapped["engine"]
        loss = token_cross_entropy(engine(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                   batch["labels"])[0]  # fmt: skip
        engine.backward(loss)
        engine.step()

    return trace_peak(model, placeholder, step, setup=setup)["total"]


def layout_estimate(run, strategy: str, world: int) -> int:
    """``pretrain plan``'s per-rank total for FSDP2 x TP / CP (``LAYOUTS``) on ``world`` ranks. Traced in a process
    that has no real process group (the test's): a fake group's context-parallel mesh traced in a rank before its
    real group made that group's collectives mismatch (a process plans or trains, as `pretrain plan` and
    `pretrain fit` do, not both)."""
    from pretrain.training import plan

    tp, cp = LAYOUTS[strategy]
    cell = plan.with_layout(run, world, tp, cp)
    layout = plan.trace(cell, run.data.micro_batch_size, run.trainer.activation_checkpointing, world, tp, cp)
    return plan.per_gpu(plan.Traces(layout, layout, layout, layout), strategy, world, cell)["total"]


def main(recipe: str, out: str, overrides: list[str]) -> None:
    from pretrain import config
    from pretrain.training import plan

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    world = int(os.environ["WORLD_SIZE"])
    run, _ = config.load(recipe, overrides)
    B, checkpointing = run.data.micro_batch_size, run.trainer.activation_checkpointing
    traces = plan.traces(
        run, B, checkpointing, world
    )  # before the real group: FSDP's is traced on a fake one
    cells = {strategy: run for strategy in STRATEGIES}
    for strategy, (tp, cp) in LAYOUTS.items():
        cells[strategy] = plan.with_layout(run, world, tp, cp)
    for strategy in STRATEGIES:
        if strategy.startswith("zero"):
            ds = replace(run.strategy.deepspeed, stage=int(strategy[4]))
            cells[strategy] = replace(run, strategy=replace(run.strategy, name="deepspeed", deepspeed=ds))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}
    for strategy in [s for s in STRATEGIES if s not in LAYOUTS] + list(LAYOUTS):  # the tp / cp meshes last
        result[strategy] = {"measured": measure(cells[strategy], strategy, world)}
        if strategy not in LAYOUTS:  # the tp / cp rows: traced by the test (``layout_estimate``)
            result[strategy]["estimate"] = plan.per_gpu(traces, strategy, world, cells[strategy])["total"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        for strategy, row in result.items():
            if "estimate" not in row:
                print(f"{strategy:<8} measured {row['measured'] / 1e6:8.3f} MB")
                continue
            error = row["estimate"] / row["measured"] - 1
            print(f"{strategy:<8} estimate {row['estimate'] / 1e6:8.3f} MB  measured {row['measured'] / 1e6:8.3f} MB"
                  f"  {error:+.1%}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
