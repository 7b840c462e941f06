"""Counter-based hashing for reproducible per-item randomness (validation split, per-sample generator seeds)."""

from __future__ import annotations

import numpy as np


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al. 2014): a bijective, well-mixing hash of uint64 ``x`` (wrapping)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
