"""One optimizer step, and the one place that knows its arithmetic.

An optimizer step sees micro-batches m = 1..k on ranks r = 1..W; the objective returns ``S_{r,m}`` (summed token
cross-entropy) and ``N_{r,m}`` (number of targets). The step's loss is

    L = sum_{r,m} S_{r,m} / N,    N = sum_{r,m} N_{r,m}

which is *not* the mean of per-micro-batch means when the target counts vary (MLM, span corruption, padding).
Lightning's automatic optimisation runs the loop (it composes with DDP, FSDP2 and DeepSpeed alike); every
quantity of it is here, in the order it happens (torchtitan's ``train_step`` reads the same)::

    for m in 1..k:                                  # StepGroups: the k micro-batches, tagged with n_r = sum_m N_{r,m}
        seed dropout from (seed, step, m, rank)     # dropout_seed: a resumed run replays the same masks
        N = all_reduce_sum(n_r)                     # StepLoss.begin, once per step (m = 1)
        S = objective.loss(model(x_m), y_m)
        backward(S * k * W / N)                     # StepLoss.add; Lightning divides by k, data parallelism by W
    g = ||grads||                                   # StepLoss.grad_norm, once: guards, clipping, logging
    S_sum, bad = all_reduce_sum([sum_m S, not finite(g)])      # StepGuard: one collective
    clip(grads, max_norm, g)
    optimizer.step(found_inf=bad or spike)          # skipped on the device, no host read
    free the gradients                              # FreeGradientsAfterStep: none lives through a forward
    L = S_sum / N                                   # read back once the step ends (guards.py)

so the accumulated gradient is exactly the gradient of L -- the same as one pass over the whole global batch.
``StepLoss`` publishes ``S`` and ``N`` of the running step for every consumer (guards, logging). Intervals in
the config count optimizer steps; :func:`micro_batches` converts them to Lightning's micro-batch counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from pretrain.objectives import IGNORE_INDEX

STEP_TARGETS = (
    "step_num_targets"  # batch key added by StepGroups: targets in this rank's micro-batches of the step
)


def micro_batches(steps: int, accumulate: int) -> int:
    """Lightning's count of micro-batches (``batch_idx``) for ``steps`` optimizer steps."""
    return steps * accumulate


def starts_step(batch_idx: int, accumulate: int) -> bool:
    """Whether Lightning's micro-batch ``batch_idx`` is the first of its optimizer step (``accumulate`` per step)."""
    return batch_idx % accumulate == 0


def ends_step(batch_idx: int, accumulate: int) -> bool:
    """Whether micro-batch ``batch_idx`` is the last of its optimizer step: the optimizer steps after it."""
    return (batch_idx + 1) % accumulate == 0


def dropout_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """Seed of the global generator before micro-batch ``micro_batch`` of ``step`` on ``rank``."""
    return int(np.random.SeedSequence([seed, step, micro_batch, rank]).generate_state(1, np.uint64)[0] >> 1)


class Loader(Protocol):
    """What :class:`StepGroups` groups: a sized iterable of batches (a ``DataLoader``)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[dict[str, Tensor]]: ...


class StepGroups:
    """Micro-batches of ``loader`` in groups of ``k`` (one optimizer step), each tagged with the group's number
    of targets (``labels != -100``). A trailing incomplete group is dropped so every step has k micro-batches."""

    def __init__(self, loader: Loader, k: int):
        self.loader, self.k = loader, k
        self.sampler = getattr(loader, "sampler", None)  # Lightning calls sampler.set_epoch

    def __len__(self) -> int:
        return len(self.loader) // self.k * self.k

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        batches = iter(self.loader)
        while len(group := list(itertools.islice(batches, self.k))) == self.k:
            count = cast(
                Tensor, sum((b["labels"] != IGNORE_INDEX).sum() for b in group)
            )  # of tensors: a tensor
            for batch in group:
                yield {**batch, STEP_TARGETS: count}


class StepLoss:
    """The running optimizer step's loss terms: ``loss_sum`` (this rank's ``sum_m S_m``, detached, (,)) and
    ``num_targets`` (the global N, (,)), on the device; and the loss each micro-batch backpropagates.

    ``multiplier`` is k * W (undoing Lightning's division by k and data-parallel averaging over W), times k
    again where the engine divides by its accumulation steps once more (DeepSpeed). W counts every rank: under
    tensor parallelism the tp ranks of a batch each add its targets to N, so W and N both count it tp times and
    the ratio is the data-parallel one."""

    def __init__(self, accumulate: int, world_size: int, reduce: Callable[[Tensor], Tensor], twice: bool):
        self.accumulate, self.reduce = accumulate, reduce
        self.engine_factor = accumulate if twice else 1  # undoes the engine's own division by k
        self.multiplier = accumulate * world_size * self.engine_factor
        self.loss_sum: Tensor | None = None
        self.num_targets: Tensor | None = None
        self._grad_norm: tuple[Tensor | None] | None = None  # computed once per step

    def grad_norm(self, params: list[Tensor]) -> Tensor | None:
        """The global L2 norm of ``params``' gradients (the optimizer's, in its order) before clipping, computed
        once per step for the guards, clipping and logging; a DTensor under FSDP (this rank's part in
        ``to_local()``); None without gradients (DeepSpeed keeps them in its engine)."""
        if self._grad_norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            self._grad_norm = (torch.nn.utils.get_total_norm(grads) if grads else None,)
        return self._grad_norm[0]

    def begin(self, local_targets: Tensor) -> None:
        """First micro-batch of a step: N = the all-reduced count of the step's targets."""
        self.num_targets = self.reduce(local_targets.clone())
        self.loss_sum = torch.zeros((), device=local_targets.device)
        self._grad_norm = None

    def add(self, loss_sum: Tensor) -> Tensor:
        """Record ``S_m`` and return what micro-batch m backpropagates: ``S_m * multiplier / N``."""
        assert self.num_targets is not None and self.loss_sum is not None
        self.loss_sum = self.loss_sum + loss_sum.detach().float()
        return loss_sum * self.multiplier / self.num_targets.clamp_min(1)

    def add_mean(self, mean: Tensor) -> Tensor:
        """For a module minimising each micro-batch's mean loss (the baselines, finetuning): the step's loss is
        the mean of the k * W means, each micro-batch counting as one target (``begin`` with a count of k); the
        micro-batch backpropagates ``mean`` (Lightning divides by k, data parallelism by W), times k where the
        engine divides by k once more (DeepSpeed)."""
        assert self.loss_sum is not None
        self.loss_sum = self.loss_sum + mean.detach().float()
        return mean * self.engine_factor


class StepLossHooks:
    """LightningModule side of :class:`StepLoss`: ``step_loss`` (the running optimizer step's loss, read by the
    guards) made when training starts, for the Trainer's accumulation, data-parallel world and engine, and
    ``step_mean`` recording a micro-batch's mean loss into it."""

    trainer: Any
    step_loss: StepLoss | None = None

    def start_step_loss(self) -> None:
        from pretrain.compat.lightning import engine_divides_by_accumulation

        world = self.trainer.world_size
        reduce = (lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else (lambda t: t)
        twice = engine_divides_by_accumulation(self.trainer.strategy)
        self.step_loss = StepLoss(self.trainer.accumulate_grad_batches, world, reduce, twice)

    def step_mean(self, mean: Tensor, batch_idx: int) -> Tensor:
        """Record micro-batch ``batch_idx``'s mean loss (over the ranks' mean: ``mean`` of every rank averages to
        it) for the guards (``StepLoss.add_mean``); return what it backpropagates."""
        k, step = self.trainer.accumulate_grad_batches, self.step_loss
        assert step is not None
        if starts_step(batch_idx, k):
            step.begin(torch.tensor(k, device=mean.device))
        return step.add_mean(mean)


class FreeGradientsAfterStep:
    """LightningModule hooks: the gradients freed right after each update, as a plain loop (and torchtitan's
    ``train_step``) does. Lightning's automatic optimisation frees them just before the next backward, so a step's
    gradients stay alive through the next forward: a larger working set every step (~1.5 CPU-ms of a ~53 ms step of
    the tiny GPT, ``benchmarks/bench_step_overhead.py``). An engine that accumulates itself (DeepSpeed: the
    optimizer-step hook runs on every micro-batch and its ``step`` updates on the last) keeps Lightning's order."""

    trainer: Any

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        optimizer.step(closure=optimizer_closure)
        if not self.trainer.strategy.handles_gradient_accumulation:
            optimizer.zero_grad(set_to_none=True)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self.trainer.strategy.handles_gradient_accumulation:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)  # type: ignore[misc]  # Lightning's
