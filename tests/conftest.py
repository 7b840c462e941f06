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
    """``../shared/data`` (or ``$PRETRAIN_SHARED_DATA``); tests that read real data skip when it is absent."""
    path = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"real data directory {path} not present (set PRETRAIN_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def shipped_corpus() -> Path:
    return SHIPPED_CORPUS
