"""Tensor and sequence parallelism applied from outside the model, as torchtitan applies it.

Each model declares its plan next to its FSDP units (``Transformer.tp_plan``: torch's DTensor ``ParallelStyle``s by
module name); :func:`apply_tensor_parallel` hands it to ``torch.distributed.tensor.parallel.parallelize_module``
on the mesh's ``tp`` dim. DTensor then does every collective (all-gather, reduce-scatter, all-reduce), forward
and backward; nothing here communicates itself. The cross entropy over the vocabulary-sharded logits is torch's
``loss_parallel`` (:func:`vocabulary_parallel`), forward and backward.

Dropout: the training step seeds the global generator from the data-parallel rank (``dropout_seed``), so the
tensor-parallel ranks of a batch draw the same masks on the activations they replicate. Where they split the
activations (a rank's attention heads; with sequence parallelism, its slice of the sequence) each must draw its
own (Megatron-LM's model-parallel RNG): around such a module (``Transformer.tp_sharded_randomness``) the
generators are re-seeded from (the shared generator's state, tp rank), and after it from that state alone
(:class:`RankRandomness`). The seeds replay under activation checkpointing, which restores the generator before
recomputing.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module


class TensorParallelPlan(Protocol):
    """What a model with a tensor-parallel plan provides (:class:`pretrain.models.transformer.Transformer`)."""

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, Any]: ...

    def tie_weights(self) -> None: ...

    def tp_sharded_randomness(self, sequence_parallel: bool = False) -> list[nn.Module]: ...


def tensor_parallel_models(module: nn.Module) -> list[nn.Module]:
    """The models inside ``module`` that declare a tensor-parallel plan (``tp_plan``)."""
    return [m for m in module.modules() if hasattr(m, "tp_plan")]


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> None:
    """Parallelise every model of :func:`tensor_parallel_models` in place on the 1-D mesh ``tp_mesh`` by its own
    plan, re-tie its weights and give each rank its own dropout where its activations are its own."""
    rank = tp_mesh.get_local_rank()
    for model in tensor_parallel_models(module):
        planned = cast(TensorParallelPlan, model)  # tensor_parallel_models keeps the modules with a tp_plan
        parallelize_module(model, tp_mesh, planned.tp_plan(sequence_parallel))
        planned.tie_weights()
        for sub in planned.tp_sharded_randomness(sequence_parallel):
            RankRandomness(rank).attach(sub)


class Replicated(ParallelStyle):
    """Every tensor-parallel rank holds the module's parameters whole, as ``Replicate`` DTensors of the tp mesh,
    so that all of a model's parameters live on one mesh (FSDP2's 2-D sharding, gradient clipping and the fused
    optimizer see one layout: torchtitan's ``NoParallel``). The module's first input enters as a DTensor of
    ``input_layout`` -- ``Replicate`` where every rank holds it whole; ``Shard(1)`` where it holds a rank's heads
    (q_norm, k_norm: their weight gradient is then summed over the ranks) -- and its output leaves as the local
    tensor."""

    def __init__(self, input_layout: Placement | None = None) -> None:
        self.input_layout = input_layout or Replicate()

    def _enter(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return (DTensor.from_local(inputs[0], mesh, (self.input_layout,), run_check=False), *inputs[1:])

    @staticmethod
    def _leave(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch annotates input_fn/output_fn as returning None, but uses what they return as the inputs/output
        return distribute_module(
            module,
            device_mesh,
            input_fn=self._enter,  # type: ignore[arg-type]
            output_fn=self._leave,  # type: ignore[arg-type]
        )


class RankRandomness:
    """Forward hooks giving a module this tensor-parallel rank's own random stream. The ranks' shared stream (the
    CPU generator, which the ranks hold equal) is hashed into two seeds: one, mixed with ``rank``, seeds the
    generators (CPU and accelerator) for the module's forward; after it, the other seeds them again, so the
    shared stream goes on alike on every rank and anew after each call. No tensor is drawn or read back: the
    seeds are a pure function of the generator state, which activation checkpointing restores before it
    recomputes a block."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._continue = 0
        self._device: torch.device | None = None

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave)

    def _seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        if self._device is not None:
            torch.get_device_module(self._device).manual_seed(seed)

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        state = torch.default_generator.get_state()
        # traced on fake tensors (``pretrain plan``) the state has no values, and the draws need none
        digest = (
            bytes(16)
            if hasattr(state, "fake_mode")
            else hashlib.blake2b(state.numpy().tobytes(), digest_size=16).digest()
        )
        shared, self._continue = (int.from_bytes(digest[i : i + 8], "little") >> 1 for i in (0, 8))
        device = args[0].device
        self._device = device if device.type != "cpu" else None
        self._seed(int(np.random.SeedSequence([shared, self.rank]).generate_state(1, np.uint64)[0] >> 1))

    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._seed(self._continue)


@contextlib.contextmanager
def vocabulary_parallel(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel`` when ``enabled`` (the cross entropy of vocabulary-sharded logits; needed around
    the loss and around its backward), else nothing."""
    if not enabled:
        yield
        return
    with loss_parallel():
        yield
