"""Rotary position embeddings (Su et al. 2021, "RoFormer") and their context-extension scalings.

The query and key of position p are rotated pairwise (HF Llama's convention: x_i pairs with x_{i + d/2}) by the
angles p f_i, with frequencies f_i = theta^(-2i/d), i < d/2, d = head_dim. A scaling (``ModelConfig.rope_scaling``,
fields in :class:`pretrain.models.config.RopeScaling`) changes the f_i and may scale cos and sin by an attention
factor m (the logits by m^2). With s = ``factor`` and L = ``original_max_seq_len``:

    linear   f_i / s
    dynamic  theta' = theta (s n / L - (s - 1))^(d / (d - 2)) at a call whose largest position is n - 1 >= L
    yarn     r_i f_i / s + (1 - r_i) f_i, r_i = clamp((i - lo) / (hi - lo), 0, 1), lo / hi the dimensions turning
             beta_fast / beta_slow times over L: fast dimensions keep f_i, slow ones are interpolated;
             m = 0.1 ln s + 1 unless given
    llama3   wavelength 2 pi / f_i above L / low_freq_factor: f_i / s; below L / high_freq_factor: f_i; between,
             (1 - a) f_i / s + a f_i with a = (L / wavelength - low) / (high - low)

These are transformers' formulas (``transformers.modeling_rope_utils``, v5), checked against ``LlamaForCausalLM`` on
identical weights in ``tests/integration/test_hf.py``. Dynamic NTK depends on the length of each call, as in
transformers: the frequencies are recomputed from that call's largest position (on the device, no host sync), so
during cached generation each new token is rotated at the current length while the cached keys keep the rotation
they were given. (transformers also keeps the longest length seen so far in the module and reuses it for a later,
shorter call above L; this module keeps no state: each call uses its own length.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pretrain.models.config import RopeScaling


def default_frequencies(dim: int, theta: float) -> Tensor:
    """(d/2,) f_i = theta^(-2i/d)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _set(value: float | None, name: str) -> float:
    """A field ``ModelConfig`` requires of this scaling type (it fills ``original_max_seq_len``)."""
    assert value is not None, f"rope_scaling.{name} is checked by ModelConfig"
    return value


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """m: ``attention_factor``, else mscale(s, mscale) / mscale(s, mscale_all_dim) when both are set (non-zero),
    else 0.1 ln s + 1."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = _set(scaling.factor, "factor")
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_frequencies(dim: int, theta: float, s: RopeScaling) -> Tensor:
    L, factor = _set(s.original_max_seq_len, "original_max_seq_len"), _set(s.factor, "factor")

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times over L
        return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero division
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    wavelength_ratio = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)  # 1 / f_i
    return ramp / (factor * wavelength_ratio) + (1 - ramp) / wavelength_ratio


def _llama3_frequencies(dim: int, theta: float, s: RopeScaling) -> Tensor:
    base = default_frequencies(dim, theta)
    L = _set(s.original_max_seq_len, "original_max_seq_len")
    low, high = _set(s.low_freq_factor, "low_freq_factor"), _set(s.high_freq_factor, "high_freq_factor")
    factor = _set(s.factor, "factor")
    wavelength = 2 * math.pi / base
    scaled = torch.where(wavelength > L / low, base / factor, base)
    smooth = (L / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= L / high) & (wavelength <= L / low)
    return torch.where(medium, smoothed, scaled)


def frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """(d/2,) frequencies and the cos/sin factor m of a static scaling; for dynamic NTK the original frequencies
    (those of every call within L; :func:`dynamic_frequencies` beyond)."""
    if scaling is None or scaling.type == "dynamic":
        return default_frequencies(dim, theta), 1.0
    if scaling.type == "linear":
        return default_frequencies(dim, theta) / _set(scaling.factor, "factor"), 1.0
    if scaling.type == "yarn":
        return _yarn_frequencies(dim, theta, scaling), yarn_attention_factor(scaling)
    if scaling.type == "llama3":
        return _llama3_frequencies(dim, theta, scaling), 1.0
    raise ValueError(f"rope_scaling.type {scaling.type!r} is not one of linear, dynamic, yarn, llama3")


def dynamic_frequencies(dim: int, theta: float, scaling: RopeScaling, seq_len: Tensor) -> Tensor:
    """Dynamic NTK frequencies at length ``seq_len`` (a 0-d tensor; lengths <= L give the original ones)."""
    L, s = _set(scaling.original_max_seq_len, "original_max_seq_len"), _set(scaling.factor, "factor")
    n = seq_len.float().clamp(min=L)
    theta_n = theta * (s * n / L - (s - 1)) ** (dim / (dim - 2))
    return 1.0 / (theta_n ** (torch.arange(0, dim, 2, device=n.device, dtype=torch.float) / dim))


class Rotary(nn.Module):
    """cos and sin of the rotation angles p f_i (times m), for ``head_dim`` d, base ``theta`` and ``scaling``."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = head_dim, theta, scaling
        self.dynamic = scaling is not None and scaling.type == "dynamic"
        inv_freq, self.attention_factor = frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (B|1, T) -> cos, sin each (B|1, 1, T, d)."""
        inv_freq = self.inv_freq
        if self.dynamic:
            assert self.scaling is not None  # a dynamic one
            seq_len = positions.max() + 1
            scaled = dynamic_frequencies(self.dim, self.theta, self.scaling, seq_len)
            L = _set(self.scaling.original_max_seq_len, "original_max_seq_len")
            inv_freq = torch.where(seq_len > L, scaled, inv_freq)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the last axis (HF Llama convention: halves, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, T, d_h) rotated: x cos + rotate_half(x) sin."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
