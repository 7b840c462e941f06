"""pretrain.memory: tensors whose memory goes back to the OS when freed."""

from __future__ import annotations

import os

import torch

from pretrain.memory import unpooled


def test_a_tensor_read_for_conversion_gives_its_memory_back_to_the_os_when_dropped():
    """``unpooled``: a conversion's tensors live in mappings of their own, so the resident size falls back
    once each is written and dropped. From malloc (``torch.empty``), blocks under its mmap threshold (up to 32 MiB)
    freed below a later small allocation stay in its heap: this pattern kept 13-37 MiB."""

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    # a freed 12 MiB block raises glibc's mmap threshold, as a conversion's first tensors do
    warm = torch.empty(3 << 20)
    warm.fill_(0)
    del warm
    before, kept = resident_mib(), []
    for mib in (4, 6, 8, 10, 12):  # growing tensors, each followed by a small allocation that outlives it
        tensor = unpooled(torch.Size([mib << 18]), torch.float32)
        tensor.fill_(1.0)
        kept.append(torch.ones(256))
        del tensor
    assert resident_mib() - before < 4
