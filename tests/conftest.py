"""Shared fixtures: the real-data directory (configurable), the tiny tokenizer + prepared corpus of the training
tests, and small deterministic settings. Test modules never import each other: helpers live in plain modules
(``training_utils.py``, ``model_zoo.py``, ``objective_data.py``) beside this file."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"

# one thread per test process: `make test` runs four pytest workers on 2 cores, and tiny kernels run
# far faster on one thread than on two contended ones (OpenMP barriers); subprocess runs get OMP_NUM_THREADS=1 too
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with end-to-end runs (a ``slow`` test) first, each file's own order kept: under ``make test``'s
    workers (``--dist loadfile`` hands out whole files in this order) the long files start early and the short ones
    fill the end, instead of one worker running a long file alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of it), read with ``mincore`` over an untouched mapping."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(mapped)))
        vector = (ctypes.c_ubyte * pages)()
        assert libc.mincore(address, ctypes.c_size_t(size), vector) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vector), pages


@pytest.fixture
def resident_pages() -> Callable[[Path], tuple[int, int]]:
    """How much of a file is in the page cache: ``resident_pages(path)`` -> (resident pages, pages)."""
    return _resident_pages


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.fixture
def direct_io(tmp_path) -> None:
    """Skips where ``tmp_path``'s file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6: what goes around the
    page cache there goes through it, ``direct_write``'s fallback, tested on its own) on a developer's machine;
    fails in CI (``CI=true``), where that means missing coverage."""
    probe = tmp_path / ".direct-io-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        message = f"{tmp_path}'s file system refuses O_DIRECT"
        if _in_ci():
            pytest.fail(f"{message}; in CI the direct-I/O tests must run (pytest --basetemp on ext4 or xfs)")
        pytest.skip(message)
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or ``$PRETRAIN_SHARED_DATA``). Tests that read real data skip when it is absent on a
    developer's machine, and fail in CI (``CI=true``), where a missing directory means missing coverage."""
    path = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        message = f"real data directory {path} not present (set PRETRAIN_SHARED_DATA)"
        if _in_ci():
            pytest.fail(f"{message}; in CI the reference tests on real data must run", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def shipped_corpus() -> Path:
    return SHIPPED_CORPUS


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict[str, Path]:
    """``{"tokenizer": tokenizer.json, "data": prepared dir, "corpus": text}`` from 200 kB of the shipped corpus."""
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("tiny_world")
    corpus = root / "corpus.txt"
    corpus.write_text(SHIPPED_CORPUS.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    tokenizer = root / "tokenizer.json"
    train_bpe([corpus], 512, tokenizer, min_frequency=2, show_progress=False)
    data = root / "data"
    prepare([corpus], tokenizer, data, val_fraction=0.1, progress=False)
    return {"tokenizer": tokenizer, "data": data, "corpus": corpus}


@pytest.fixture(scope="session")
def tiny_gpt_run(tmp_path_factory, tiny_world) -> dict[str, Path]:
    """A tiny GPT trained for 4 steps (validation at 2 and 4) through `pretrain fit` in process, shared by the
    modules that read a trained checkpoint: ``{"recipe", "ckpt": last.ckpt, "dir"}``. Read it, never write to it."""
    from training_utils import tiny_recipe

    from pretrain.cli import main

    directory = tmp_path_factory.mktemp("tiny_gpt_run")
    trainer = {"max_steps": 4, "val_check_interval": 2}
    recipe = tiny_recipe(directory, tiny_world, "gpt", trainer=trainer, logger={"curves": True})
    assert main(["fit", str(recipe)]) == 0
    return {"recipe": recipe, "ckpt": directory / "run" / "checkpoints" / "last.ckpt", "dir": directory}


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> dict:
    """The recipes' tokenizer and prepared corpus, made by `pretrain tokenizer` / `pretrain prepare` on
    recipes/gpt-tiny.yaml: ``{"root", "paths": the overrides pointing a recipe at them, "unigram": the unigram
    entropy of the training tokens (nats)}``."""
    import numpy as np
    from training_utils import run_cli

    from pretrain.datamodules.indexed import IndexedDataset

    root = tmp_path_factory.mktemp("shakespeare")
    paths = [f"tokenizer.path={root / 'tokenizer.json'}", f"data.sources.0.prepared={root / 'data'}"]
    run_cli("tokenizer", "recipes/gpt-tiny.yaml", *paths)
    run_cli("prepare", "recipes/gpt-tiny.yaml", *paths)
    p = np.bincount(np.asarray(IndexedDataset(root / "data" / "train").tokens))
    p = p[p > 0] / p.sum()  # H = -sum_v p(v) log p(v): the loss of the best context-free predictor of a token
    return {"root": root, "paths": paths, "unigram": float(-(p * np.log(p)).sum())}
