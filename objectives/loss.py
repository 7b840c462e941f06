"""Token-level cross-entropy normalised by the number of target tokens of the whole global batch.

With gradient accumulation over micro-batches m and data-parallel ranks r, the correct loss is

    L = sum_{r,m} S_{r,m} / sum_{r,m} N_{r,m}

(S = summed token cross-entropy, N = number of targets), not the mean of per-micro-batch means
``mean_{r,m}(S_{r,m} / N_{r,m})``, which over-weights micro-batches with few targets (MLM and span corruption
have a varying number of targets per micro-batch). The objectives return ``(S, N)`` per micro-batch; the training
step (``pretrain.training.module``) all-reduces N over the step and normalises.

Under tensor parallelism the logits are a DTensor sharded over the vocabulary and are never gathered: the cross
entropy is torch's ``loss_parallel`` (the caller's context), the accuracy count compares each rank's slice with
the all-reduced maximum.
"""

from __future__ import annotations

from typing import cast

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def token_cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``logits (B, T, V)``, ``labels (B, T)`` (-100 = ignored) -> ``(loss_sum, num_targets)`` scalars.

    The sum is computed in float32 whatever the logits' dtype; vocabulary-sharded logits (inside
    ``loss_parallel``) give it as a plain tensor too.
    """
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if hasattr(loss_sum, "full_tensor"):  # loss_parallel's result: replicated over the tensor-parallel ranks
        loss_sum = loss_sum.full_tensor()
    return loss_sum, (labels != IGNORE_INDEX).sum()


def num_correct(logits: Tensor, labels: Tensor) -> Tensor:
    """Targets whose label has the largest logit (``argmax == label``), a scalar; ``logits (..., V)``,
    ``labels (...)``. Vocabulary-sharded logits (a DTensor) count a target on the rank holding its label when
    that logit equals the maximum over every rank (DTensor's all-reduced ``amax``), so an exact tie counts as
    correct there, where ``argmax`` takes the first index."""
    targets = labels != IGNORE_INDEX
    if not hasattr(logits, "full_tensor"):
        return ((logits.argmax(-1) == labels) & targets).sum()
    from torch.distributed.tensor import DTensor, Partial

    assert isinstance(logits, DTensor)
    top = cast(DTensor, logits.amax(-1)).full_tensor()  # torch types DTensor ops as returning Tensor
    local = logits.to_local()  # this rank's vocabulary slice: ids start .. start + V_local
    width = local.shape[-1]
    index = labels - logits.device_mesh.get_local_rank() * width
    here = targets & (index >= 0) & (index < width)
    label_logit = local.gather(-1, index.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    hits = (here & (label_logit >= top)).sum()
    return DTensor.from_local(hits, logits.device_mesh, [Partial()]).full_tensor()
