"""Issue 22, prepare / tokenizer faults that need a process of their own: a full disk (a file-size limit) and the
peak memory of a long document."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from training_utils import CORPUS, REPO_ROOT, cli_env, tiny_recipe

from pretrain.datamodules.indexed import IndexedDataset


def source_recipe(tmp_path, world, *sources):
    data = {"sources": [{"name": f"s{i}", **s} for i, s in enumerate(sources)]}
    return tiny_recipe(tmp_path, world, "gpt", data=data)


def _limited(max_bytes: int):
    def limit() -> None:  # a full disk, as the process sees it: writes past max_bytes fail (EFBIG)
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def _cli_with_full_disk(max_bytes: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *map(str, args)],
        cwd=REPO_ROOT,
        env=cli_env(PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        preexec_fn=_limited(max_bytes),
        timeout=300,
        check=False,
    )


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_full_disk_keeps_the_tokenizer_and_names_the_path(tmp_path, tiny_world):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(tiny_world["tokenizer"].read_bytes())
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:20_000])
    recipe = tiny_recipe(
        tmp_path,
        tiny_world,
        "gpt",
        tokenizer={"path": str(tokenizer), "train_files": [str(corpus)], "vocab_size": 512},
    )
    before = tokenizer.read_bytes()
    proc = _cli_with_full_disk(4096, "tokenizer", recipe, "--force")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tmp_path) in proc.stderr and "File too large" in proc.stderr
    assert tokenizer.read_bytes() == before  # not truncated in place

    recipe = source_recipe(tmp_path, tiny_world, {"text": [str(corpus)], "prepared": str(tmp_path / "p")})
    proc = _cli_with_full_disk(4096, "prepare", recipe)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tmp_path / ".p.tmp-") in proc.stderr
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )  # nothing half-written left


_LONG_DOC = """
import re, sys
from pathlib import Path
from pretrain.datamodules.prepare import prepare
prepare(sys.argv[1], sys.argv[2], sys.argv[3], document="file", val_fraction=0, piece_chars=int(sys.argv[4]), progress=False)
print(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc peak RSS")
def test_a_long_single_line_document_has_bounded_memory_and_identical_ids(tmp_path, tiny_world):
    """A 2 MB one-line document: in pieces, peak RSS stays far below encoding it whole; the ids are identical."""
    text = CORPUS.read_text()[:200_000].replace("\n", " ")
    (tmp_path / "long.txt").write_text((text + " ") * 10)
    peaks = {}
    for piece in (1 << 16, 1 << 30):  # 1 << 30: one piece, the whole document at once (the old behaviour)
        out = tmp_path / f"p{piece}"
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _LONG_DOC,
                str(tmp_path / "long.txt"),
                str(tiny_world["tokenizer"]),
                str(out),
                str(piece),
            ],
            capture_output=True,
            text=True,
            check=True,
            env=cli_env(PYTHONWARNINGS="ignore"),
        )
        peaks[piece] = int(proc.stdout.split()[-1])
    assert (
        IndexedDataset(tmp_path / "p65536/train")[0].tolist()
        == IndexedDataset(tmp_path / f"p{1 << 30}/train")[0].tolist()
    )
    assert peaks[1 << 16] < peaks[1 << 30] - 150_000, (
        peaks
    )  # kB: whole, it costs ~240 MB more (120x the text)
