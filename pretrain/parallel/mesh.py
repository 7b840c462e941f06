"""The run's device mesh: every kind of parallelism is one named dimension of one mesh, built here.

    dim (outer to inner)   size                                  splits
    dp_replicate           trainer.num_nodes under HYBRID_SHARD  the data; FSDP2 replicates the shards over it
                           (else 1)
    dp_shard               the ranks left                        the data; FSDP2 shards parameters over it
    cp                     strategy.context_parallel             every sequence (``pretrain.parallel.context``)
    tp                     strategy.tensor_parallel              attention heads, MLP width, vocabulary (and,
                                                                 with sequence_parallel, the sequence)

World = dp_replicate x dp_shard x cp x tp ranks, laid out row-major (torchtitan's order): the tp ranks of a group
are consecutive, on one node, then the cp groups. A data-parallel rank is a (dp_replicate, dp_shard) coordinate:
its cp x tp ranks read the same batch, each cp rank its positions of every sequence. FSDP2 shards parameters over
dp_shard x cp flattened into one dim (``dp_shard_cp``, torchtitan's): the cp ranks hold the same parameters and
their gradients are reduced with the data-parallel ones.

Nothing here imports torch.distributed until a mesh is built, so configs are checked before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dims (:data:`DIMS`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, run: Any) -> ParallelDims:
        """The mesh of a ``RunConfig`` (checked by :func:`parallel_problems`)."""
        tp, cp = run.strategy.tensor_parallel, run.strategy.context_parallel
        world = run.trainer.devices * run.trainer.num_nodes
        hybrid = run.strategy.name == "fsdp" and run.strategy.fsdp.sharding_strategy == "HYBRID_SHARD"
        replicate = run.trainer.num_nodes if hybrid else 1
        return cls(replicate, world // (replicate * cp * tp), cp, tp)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIMS)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different batches a step reads."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, global_rank: int) -> int:
        """The data-parallel coordinate of ``global_rank`` (row-major: a data-parallel rank's cp x tp ranks are
        consecutive)."""
        return global_rank // (self.cp * self.tp)

    def cp_rank(self, global_rank: int) -> int:
        """The context-parallel coordinate of ``global_rank``: which positions of every sequence it holds."""
        return global_rank // self.tp % self.cp

    def build(self, device_type: str) -> RunMesh:
        """The mesh over every rank of the (initialised) default process group, dims named, and its sub-meshes."""
        from torch.distributed.device_mesh import init_device_mesh

        from pretrain.compat.collectives import flatten

        root = init_device_mesh(device_type, self.sizes, mesh_dim_names=DIMS)
        shard = "dp_shard"
        if self.cp > 1:  # FSDP2 shards over the data-parallel and the context-parallel ranks together
            shard = "dp_shard_cp"
            flatten(root["dp_shard", "cp"], shard)
        data_parallel = root["dp_replicate", shard] if self.dp_replicate > 1 else root[shard]
        return RunMesh(self, root, data_parallel, root["cp"], root["tp"])


@dataclass(frozen=True)
class RunMesh:
    """The run's ``DeviceMesh`` (``root``) and the sub-meshes each parallelism works on, sliced once when it is
    built (slicing reads the mesh's rank tensor, which a fake-tensor mode -- ``pretrain plan`` -- cannot)."""

    dims: ParallelDims
    root: Any
    data_parallel: (
        Any  # FSDP2's: dp_shard (dp_shard_cp), or (dp_replicate, dp_shard[_cp]) for hybrid sharding
    )
    cp: Any
    tp: Any


def parallel_problems(run: Any) -> list[str]:
    """One line per setting the mesh cannot have: tensor or context parallelism outside FSDP2, a mesh that does
    not divide the devices, a model whose heads, key/value heads, MLP width or vocabulary do not split evenly, a
    sequence length that does not split into 2 x context_parallel chunks, sequence parallelism without tensor
    parallelism."""
    s, t, m = run.strategy, run.trainer, run.model
    tp, cp = s.tensor_parallel, s.context_parallel
    for key, value in (("tensor_parallel", tp), ("context_parallel", cp)):
        if value < 1:
            return [f"strategy.{key} must be >= 1, got {value}"]
    if s.sequence_parallel and tp == 1:
        return [
            "strategy.sequence_parallel=true splits the sequence among a tensor-parallel group's ranks: set "
            + "strategy.tensor_parallel >= 2 (or sequence_parallel=false)"
        ]
    if tp == 1 and cp == 1:
        return []
    split = [f"strategy.{k}={v}" for k, v in (("tensor_parallel", tp), ("context_parallel", cp)) if v > 1]
    if s.name != "fsdp":
        return [
            f"{' and '.join(split)} needs strategy.name=fsdp (DTensor tensor and context parallelism compose "
            + f"with FSDP2 on one device mesh; {s.name} replicates or flattens whole parameters); set "
            + "strategy.name=fsdp"
        ]
    problems = []
    if t.devices % (tp * cp):
        problems.append(
            f"trainer.devices={t.devices} is not a multiple of {' x '.join(split)}: each node's devices form "
            f"groups of {tp * cp} ranks that read the same batch"
        )
    if cp > 1 and run.data.seq_len % (2 * cp):
        problems.append(
            f"data.seq_len={run.data.seq_len} is not a multiple of 2 x strategy.context_parallel = {2 * cp}: "
            "every sequence is cut into 2 x context_parallel load-balanced chunks; pick a seq_len that is"
        )
    if tp > 1 and s.fsdp.cpu_offload:
        problems.append(
            "strategy.fsdp.cpu_offload=true with strategy.tensor_parallel > 1 is not supported (FSDP2 offloads "
            "whole parameters); set one of them back"
        )
    for field, value, what in (
        ("n_head", m.n_head, "attention heads"),
        ("n_kv_head", m.n_kv_head, "key/value heads"),
        ("d_ff", m.d_ff, "MLP width"),
        ("vocab_size", m.vocab_size, "vocabulary (embedding and LM head rows)"),
    ):
        if value % tp and not (field == "n_kv_head" and m.n_kv_head == m.n_head):
            problems.append(
                f"model.{field}={value} is not divisible by strategy.tensor_parallel={tp}: the {what} split "
                f"evenly over the tensor-parallel ranks; pick a tensor_parallel that divides it"
            )
    if getattr(run, "eval_during_fit", None) is not None and run.eval_during_fit.tasks:
        problems.append(
            f"eval_during_fit with {' and '.join(split)} is not supported (its scorer reads whole sequences and "
            "logits on every rank); drop eval_during_fit.tasks and score checkpoints with `pretrain evaluate`"
        )
    if tp > 1 and t.float8:
        problems.append(
            "trainer.float8=true with strategy.tensor_parallel > 1 is not supported (torchao's float8 needs its "
            "own tensor-parallel styles); set one of them back"
        )
    return problems


def data_parallel_position(trainer: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel ranks, from the strategy's sampler arguments
    (the ranks of a tensor-parallel group read the same batch: one position); ``(0, 1)`` on one device."""
    kwargs = trainer.distributed_sampler_kwargs
    return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)


def context_parallel_position(trainer: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process among the context-parallel ranks of its data-parallel rank (which
    positions of every sequence it holds, ``pretrain.parallel.context``); ``(0, 1)`` without context
    parallelism."""
    dims = getattr(trainer.strategy, "dims", None)
    if not isinstance(dims, ParallelDims) or dims.cp == 1:
        return 0, 1
    return dims.cp_rank(trainer.global_rank), dims.cp
