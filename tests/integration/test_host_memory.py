"""trainer.reuse_host_memory: a step's freed host memory is reused by the next step instead of being returned to
the OS and faulted in again (minor page faults per step, in a fresh process: mallopt is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from training_utils import REPO_ROOT

STEPS = """
import resource
import torch
from pretrain.training.host_memory import reuse_freed_memory

def faults_per_step(steps=10):
    def step():  # 30 MiB of activations, freed at the end
        kept = [torch.empty(1 << 18).fill_(1.0) for _ in range(30)]
        del kept
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps

print(faults_per_step(), reuse_freed_memory(), faults_per_step())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_is_reused_by_the_next_step():
    out = subprocess.run(
        [sys.executable, "-c", STEPS], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    default, applied, reused = float(out[0]), out[1], float(out[2])
    assert default > 5000  # glibc's defaults: 30 MiB faulted in again every step (7,680 pages)
    assert applied == "True" and reused < 100
