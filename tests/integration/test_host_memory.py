"""trainer.reuse_host_memory: a step's freed host memory is reused by the next step instead of being returned to
the OS and faulted in again (minor page faults per step, in a fresh process: mallopt is process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from training_utils import REPO_ROOT

STEPS = """
import resource
import torch
from pretrain.training.host_memory import reuse_freed_memory

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
x = torch.randn(512, 256)

def faults_per_step(steps=10):
    def step():  # activations and gradients of 0.5-4 MiB, freed at the end of the step
        model(x).square().mean().backward()
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
        [sys.executable, "-c", STEPS],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    default, applied, reused = float(out[0]), out[1], float(out[2])
    assert default > 400  # glibc's defaults: megabytes faulted in again every step (~800-1,200 pages)
    assert applied == "True" and reused < default / 10
