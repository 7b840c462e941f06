"""The distributed strategy of a run: DDP, FSDP2 (per-block ``fully_shard``) or DeepSpeed ZeRO-1/2/3, on GPUs or
on the CPU (gloo) -- the same code path either way.

FSDP follows torchtitan: every transformer block, then the whole backbone, is wrapped with FSDP2's
``fully_shard`` from outside the model. Parameters stay ``DTensor``s of their full shape, so weight decay, FLOPs
and gradient-norm clipping see the unsharded model; gradients are reduced in float32 (bf16-mixed autocasts the
compute only, as under DDP); checkpoints are torch.distributed.checkpoint directories.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn

from pretrain.checkpoint.async_save import AsyncCheckpointIO, AsyncCheckpointWriter
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.config.run import TrainingRun
from pretrain.errors import InputError
from pretrain.parallel.mesh import ParallelDims, RunMesh


def deepspeed_config(run: TrainingRun) -> dict[str, Any]:
    """DeepSpeed JSON config for ZeRO stage 1/2/3 with optional CPU offload.

    The micro-batch is the datamodule's (Lightning cannot infer it from our batch sampler); Lightning fills in
    gradient accumulation, clipping and precision from the Trainer.
    """
    ds = run.strategy.deepspeed
    if (ds.offload_optimizer or ds.offload_parameters) and ds.stage == 1:
        raise InputError(
            "strategy.deepspeed: CPU offload needs ZeRO stage 2 or 3; set strategy.deepspeed.stage"
        )
    if ds.offload_parameters and ds.stage != 3:
        raise InputError("strategy.deepspeed.offload_parameters needs ZeRO stage 3")
    if ds.param_persistence_threshold < 0:
        raise InputError(
            f"strategy.deepspeed.param_persistence_threshold must be >= 0, got {ds.param_persistence_threshold}"
        )
    zero: dict[str, Any] = {
        "stage": ds.stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": ds.contiguous_gradients,
        "allgather_bucket_size": ds.allgather_bucket_size,
        "reduce_bucket_size": ds.reduce_bucket_size,
    }
    if ds.stage == 3:
        zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": run.data.micro_batch_size,
    }


def optimizer_offloaded(run: TrainingRun) -> bool:
    """Whether the optimizer steps on the CPU (DeepSpeed ZeRO offload: DeepSpeedCPUAdam)."""
    return run.strategy.name == "deepspeed" and run.strategy.deepspeed.offload_optimizer


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: those every submodule declares with ``fsdp_units()`` (the
    ``Transformer``: its blocks)."""
    declared = (getattr(sub, "fsdp_units", None) for sub in module.modules())
    return [unit for units in declared if units is not None for unit in units()]


def shard_model(
    module: nn.Module, mesh: Any, *, reshard_after_forward: bool = True, cpu_offload: bool = False
) -> None:
    """FSDP2: ``fully_shard`` every unit of :func:`shard_units`, then each top-level child holding parameters
    (the backbone: embeddings, final norm, heads). In place; modules already sharded (a Trainer's ``validate``
    after its ``fit``) are left as they are."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for unit in shard_units(module):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, **options)
    for child in module.children():
        if any(True for _ in child.parameters()) and not isinstance(child, FSDPModule):
            fully_shard(child, **options)


def parallelize(
    module: nn.Module,
    mesh: RunMesh,
    *,
    sequence_parallel: bool = False,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """The run's parallelism on its ``mesh`` (``pretrain.parallel.mesh``), in torchtitan's order: context
    parallelism over the ``cp`` dim (the model's stacks told their group; no parameter changes), tensor (and
    sequence) parallelism over the ``tp`` dim by each model's own plan, then FSDP2 over the data-parallel dims
    (:func:`shard_model`; with context parallelism, dp_shard x cp)."""
    if mesh.dims.cp > 1:
        from pretrain.parallel.context import apply_context_parallel

        apply_context_parallel(module, mesh.cp.get_group())
    if mesh.dims.tp > 1:
        from pretrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(module, mesh.tp, sequence_parallel)
    options = {"reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload}
    shard_model(module, mesh.data_parallel, **options)


def collective_timeout(run: TrainingRun) -> timedelta:
    """How long a collective may wait: past the hang guard's stack dump (``guards.hang``)."""
    return timedelta(seconds=run.guards.hang.collective_timeout_seconds)


def build_fsdp(run: TrainingRun) -> Strategy:
    from functools import partial

    from pretrain.compat.lightning import PerModuleSharding

    fsdp = run.strategy.fsdp
    if fsdp.sharding_strategy == "NO_SHARD":
        raise InputError("strategy.fsdp.sharding_strategy=NO_SHARD is data parallel: use strategy.name=ddp")
    dims = ParallelDims.of(run)
    apply = partial(
        parallelize,
        sequence_parallel=run.strategy.sequence_parallel,
        reshard_after_forward=fsdp.sharding_strategy != "SHARD_GRAD_OP",
        cpu_offload=fsdp.cpu_offload,
    )
    sharded = fsdp.state_dict_type == "sharded"
    strategy = PerModuleSharding(
        apply,
        dims,
        save_distributed_checkpoint=sharded,
        timeout=collective_timeout(run),
    )
    # state_dict_type=full: one file, written by rank 0 (or in the background, a DCP directory)
    strategy.checkpoint_io = checkpoint_io(run)
    if sharded and run.checkpoint.async_save:
        strategy.async_writer = AsyncCheckpointWriter(run.checkpoint.async_write_share)
    return strategy


def build_deepspeed(run: TrainingRun) -> Strategy:
    if run.trainer.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    try:
        import deepspeed  # noqa: F401  (installed? and DS_ACCELERATOR read now)
    except ImportError as err:
        raise InputError(
            "strategy deepspeed needs the deepspeed package: pip install 'pretrain[deepspeed]'"
        ) from err
    from pretrain.compat.lightning import DeepSpeedAnyDevice

    return DeepSpeedAnyDevice(config=deepspeed_config(run), timeout=collective_timeout(run))


def checkpoint_io(run: TrainingRun) -> AtomicCheckpointIO:
    """How rank 0 writes a whole checkpoint: one file, atomically; with ``checkpoint.async_save``, a DCP directory
    written in the background."""
    if run.checkpoint.async_save:
        return AsyncCheckpointIO(share=run.checkpoint.async_write_share)
    return AtomicCheckpointIO()


def build_strategy(run: TrainingRun) -> str | Strategy:
    """``auto`` | DDP | FSDP2 (the model's ``fsdp_units``: one per transformer block) | DeepSpeed ZeRO, from
    ``run.strategy``."""
    s = run.strategy
    if s.name == "auto":
        return "auto"
    if s.name == "ddp":
        return DDPStrategy(
            find_unused_parameters=s.ddp.find_unused_parameters,
            static_graph=s.ddp.static_graph,
            process_group_backend=s.ddp.process_group_backend,
            timeout=collective_timeout(run),
            checkpoint_io=checkpoint_io(run),
        )
    if s.name == "fsdp":
        return build_fsdp(run)
    return build_deepspeed(run)
