"""The shapes a fitted ladder can recommend: widths in steps of about 5 % (multiples of the head dimension) with
the ladder's depth for that width (a least-squares line of log depth on log width through its sizes), and each
shape's N and F measured on the model itself (``pretrain.ladder.plan.measure``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pretrain.config import RunConfig
from pretrain.ladder.plan import Plan, Shape, measure


@dataclass(frozen=True)
class Family:
    shapes: list[Shape]
    params: np.ndarray  # N per shape
    flops_per_token: np.ndarray  # F per shape


def _depth_rule(widths: list[int], depths: list[int]) -> tuple[float, float]:
    """(u, v) of log depth = u + v log width, least squares (v = 0 when all widths are equal)."""
    x, y = np.log(widths), np.log(depths)
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    v, u = np.polyfit(x, y, 1)
    return float(u), float(v)


def family(plan: Plan, run: RunConfig, max_heads: int = 1024) -> Family:
    """Candidate shapes of ``run``'s model (a cell's recipe) along the ladder's sizes."""
    sizes = {c.shape for c in plan.cells}
    base = next(iter(sizes))
    widths = [s.d_model for s in sizes]
    enc = _depth_rule(widths, [s.n_layer for s in sizes])
    dec = _depth_rule(widths, [s.n_decoder_layer or 1 for s in sizes])
    ratio, group = base.d_ff / base.d_model, base.n_head // base.n_kv_head
    heads = sorted({round(1.05**j) for j in range(200) if round(1.05**j) <= max_heads})
    heads = [h for h in heads if h % group == 0] or [group]
    shapes, params, flops = [], [], []
    for h in heads:
        d = h * base.head_dim

        def layers(rule: tuple[float, float], d: int = d) -> int:
            return max(1, round(float(np.exp(rule[0] + rule[1] * np.log(d)))))

        one = Shape(d, 1, 1 if base.n_decoder_layer is not None else None, h, h // group, base.head_dim,
                    max(1, round(ratio * d)))  # fmt: skip
        shape = dataclasses.replace(
            one,
            n_layer=layers(enc),
            n_decoder_layer=layers(dec) if base.n_decoder_layer is not None else None,
        )
        # N and F are affine in the layer counts: measure 1 layer, then one more of each stack
        n1, f1 = measure(run, one, plan.seq_len, plan.decoder_len)
        n2, f2 = measure(run, dataclasses.replace(one, n_layer=2), plan.seq_len, plan.decoder_len)
        n, f = n1 + (shape.n_layer - 1) * (n2 - n1), f1 + (shape.n_layer - 1) * (f2 - f1)
        if shape.n_decoder_layer is not None:
            n3, f3 = measure(run, dataclasses.replace(one, n_decoder_layer=2), plan.seq_len, plan.decoder_len)
            n, f = n + (shape.n_decoder_layer - 1) * (n3 - n1), f + (shape.n_decoder_layer - 1) * (f3 - f1)
        shapes.append(shape)
        params.append(n)
        flops.append(f)
    return Family(shapes, np.array(params, float), np.array(flops, float))
