"""Shared fixtures: the real-data directory (configurable) and small deterministic settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or ``$PRETRAIN_SHARED_DATA``). Tests that read real data skip when it is absent on a
    developer's machine, and fail in CI (``CI=true``), where a missing directory means missing coverage."""
    path = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        message = f"real data directory {path} not present (set PRETRAIN_SHARED_DATA)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{message}; in CI the reference tests on real data must run", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def shipped_corpus() -> Path:
    return SHIPPED_CORPUS


@pytest.fixture
def one_thread():
    """torch on one thread for the test (as ``OMP_NUM_THREADS=1`` CLI subprocesses): on a loaded 2-core machine
    two threads cost ~100x per op of a tiny model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
