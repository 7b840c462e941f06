"""Tensors in memory of their own, given back to the OS the moment they are freed (streamed conversion and export
keep their resident memory at one tensor plus a fixed overhead with them)."""

from __future__ import annotations

import mmap

import torch


def unpooled(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in a memory mapping of its own, given back to the OS as soon as the tensor is freed.
    (``torch.empty`` takes it from malloc, which keeps freed blocks below its mmap threshold -- up to 32 MiB, raised
    by every such block freed -- in its heap: tensors of varied sizes read one after another fragmented it, and a
    conversion's resident memory grew with every layer.)"""
    numel = int(torch.Size(shape).numel())
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)
