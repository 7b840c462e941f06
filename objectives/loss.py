"""Token-level cross-entropy normalised by the number of target tokens of the whole global batch.

With gradient accumulation over micro-batches m and data-parallel ranks r, the correct loss is

    L = sum_{r,m} S_{r,m} / sum_{r,m} N_{r,m}

(S = summed token cross-entropy, N = number of targets), not the mean of per-micro-batch means
``mean_{r,m}(S_{r,m} / N_{r,m})``, which over-weights micro-batches with few targets (MLM and span corruption
have a varying number of targets per micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
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


def global_mean(loss_sums: Sequence[Tensor] | Tensor, num_targets: Sequence[Tensor] | Tensor) -> Tensor:
    """Mean token loss of a global batch from its parts' sums and target counts: ``sum(S) / sum(N)``."""
    total = torch.stack(list(loss_sums)).sum() if not isinstance(loss_sums, Tensor) else loss_sums.sum()
    count = torch.stack(list(num_targets)).sum() if not isinstance(num_targets, Tensor) else num_targets.sum()
    return total / count.clamp_min(1)


def micro_batch_loss(loss_sum: Tensor, global_num_targets: Tensor | int, world_size: int = 1) -> Tensor:
    """The value to backpropagate for one micro-batch so the accumulated gradient is that of ``global_mean``.

    ``global_num_targets`` = N summed over all micro-batches of the step and all ranks (all-reduced
    beforehand). The ``world_size`` factor undoes the gradient averaging of data-parallel training.
    """
    return loss_sum * world_size / torch.as_tensor(global_num_targets).clamp_min(1)
