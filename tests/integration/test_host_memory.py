"""trainer.reuse_host_memory: a step's freed host memory is reused by the next step instead of being returned to
the OS and faulted in again (minor page faults per step, each setting in its own fresh process as `pretrain fit`
applies it: before the first allocation, and mallopt is process-wide)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from training_utils import REPO_ROOT

WARMUP, STEPS = 5, 40
FAULTING = 256  # pages (1 MiB): a step that maps at least this much in again

FAULTS_PER_STEP = """
import json, resource, sys
import torch
from pretrain.training.host_memory import reuse_freed_memory

applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
x = torch.randn(512, 256)
faults = []
for _ in range(int(sys.argv[2])):  # activations and gradients of 0.5-4 MiB, freed at the end of the step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x).square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def faults_per_step(mode: str) -> tuple[bool | None, list[int]]:
    """Minor page faults of each step after the warm-up, in a fresh process run with `mode` (default | reuse)."""
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_STEP, mode, str(WARMUP + STEPS)],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out.splitlines()[-1])
    return result["applied"], result["faults"][WARMUP:]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_is_reused_by_the_next_step():
    _, default = faults_per_step("default")
    applied, reused = faults_per_step("reuse")
    # glibc's defaults trim the heap's top after most steps and fault megabytes in again on the next (seen here:
    # 15-30 of 35 steps, ~800-1,700 pages a step on average); with the thresholds set, a step faults in only
    # when the heap grows past its fragmentation (seen: 0-2 of 35 steps, once each)
    faulting = [sum(f >= FAULTING for f in faults) for faults in (default, reused)]
    assert applied is True
    assert faulting[0] >= STEPS // 4, default
    assert faulting[1] <= STEPS // 10, reused
    assert sum(reused) < sum(default) / 5, (default, reused)
