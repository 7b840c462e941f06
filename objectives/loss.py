"""Token-level cross-entropy normalised by the number of target tokens of the whole global batch.

With gradient accumulation over micro-batches m and data-parallel ranks r, the correct loss is

    L = sum_{r,m} S_{r,m} / sum_{r,m} N_{r,m}

(S = summed token cross-entropy, N = number of targets), not the mean of per-micro-batch means
``mean_{r,m}(S_{r,m} / N_{r,m})``, which over-weights micro-batches with few targets (MLM and span corruption
have a varying number of targets per micro-batch). The objectives return ``(S, N)`` per micro-batch; the training
step (``pretrain.training.module``) all-reduces N over the step and normalises.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def token_cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``logits (B, T, V)``, ``labels (B, T)`` (-100 = ignored) -> ``(loss_sum, num_targets)`` scalars.

    The sum is computed in float32 whatever the logits' dtype.
    """
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (labels != IGNORE_INDEX).sum()
