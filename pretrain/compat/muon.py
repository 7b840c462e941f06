"""Muon's Newton-Schulz iteration in a chosen dtype (``optim.muon.ns_dtype``): the one use of torch's private
Muon internals (tested with torch 2.13.0).

``torch.optim.Muon`` orthogonalises each update in bfloat16 (``torch.optim._muon._zeropower_via_newtonschulz``,
as Keller Jordan's reference does): fast where matmuls have native bf16 (CUDA; CPUs with AVX512-BF16 or AMX),
but a CPU without it emulates bf16 matmuls, 12.5x slower than float32 on an AVX2 AMD EPYC (Zen 1). ``float32``
runs the same quintic iteration (coefficients (a, b, c), ``ns_steps`` steps) in float32:
X <- G / ||G||_F, then X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation of G. ``auto`` (the
default) picks bfloat16 on accelerators and on CPUs that report AVX512-BF16 or AMX (``torch.cpu``'s private
probes), float32 on other CPUs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(
    grad: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(out, in) -> (out, in): the orthogonalised update, computed in ``dtype`` (torch's iteration, other dtype)."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype).T if tall else grad.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def resolve(name: str, device: torch.device) -> str:
    """``auto`` -> ``bfloat16`` where matmuls have native bf16, else ``float32``; other names unchanged."""
    if name != "auto":
        return name
    if device.type != "cpu":
        return "bfloat16"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return "bfloat16" if any(getattr(torch.cpu, p, lambda: False)() for p in probes) else "float32"


@contextlib.contextmanager
def newton_schulz_dtype(name: str, zero_where: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, ``torch.optim.Muon.step`` orthogonalises in ``name`` (``bfloat16``: torch's own), and
    where ``zero_where`` (a (,) bool device tensor) is true the update is zero (a select on the device)."""
    if name == "bfloat16" and zero_where is None:
        yield
        return
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    orthogonalise = (
        original if name == "bfloat16" else functools.partial(newton_schulz, dtype=NS_DTYPES[name])
    )
    if zero_where is not None:
        inner = orthogonalise

        def orthogonalise(*args, **kwargs):
            update = inner(*args, **kwargs)
            return torch.where(zero_where, torch.zeros((), dtype=update.dtype, device=update.device), update)

    _muon._zeropower_via_newtonschulz = orthogonalise
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original
