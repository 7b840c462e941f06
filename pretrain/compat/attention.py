"""torch's private CPU attention kernel, used by ``pretrain.models.attention``'s context-parallel attention (tested
with torch 2.13.0).

- ``cpu_flash`` / ``cpu_flash_backward``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward,
  the flash kernel CPU SDPA calls. Unlike ``F.scaled_dot_product_attention`` they return (and take) the rows'
  log-sum-exp, by which attention over separate key blocks is merged or a block's backward computed alone; an
  additive float ``attn_mask`` (B|1, h|1, T, S) is read tile by tile, never expanded to the scores.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cpu_flash(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(out (B, h, T, d_h), log-sum-exp (B, h, T)) of softmax attention, q (B, h, T, d_h), k and v (B, h, S, d_h)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def cpu_flash_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float | None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k and v given the forward's (or the merged) ``out`` and ``lse``."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    dq, dk, dv = kernel(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return dq, dk, dv
