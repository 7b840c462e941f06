"""Freed host memory kept for the next step (``trainer.reuse_host_memory``; glibc's malloc, a no-op elsewhere).

A training step allocates and frees the same tensors every time. glibc returns freed memory at the top of its heap
to the OS once more than ``M_TRIM_THRESHOLD`` is free there, and serves blocks above a dynamic
``M_MMAP_THRESHOLD`` with fresh ``mmap`` s -- so every step faults its activations and gradients in again, a page
(4 KiB, zeroed by the kernel) at a time: ~1,000-1,600 minor faults and ~2-3 CPU-ms per step of the tiny GPT on
the CPU (``benchmarks/bench_step_overhead.py``). With the mmap threshold fixed at glibc's largest (32 MiB) and
the trim threshold at 1 GiB, the process keeps that memory and reuses it (what PyTorch's own CUDA caching
allocator does for device memory; jemalloc and tcmalloc, which PyTorch's CPU tuning guide suggests via
``LD_PRELOAD``, reuse it too). Process-wide and for the rest of the process (mallopt(3) has no getter); the
resident size then stays at the run's peak."""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30


def reuse_freed_memory() -> bool:
    """Set glibc's thresholds as above; whether they were set (False off glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
