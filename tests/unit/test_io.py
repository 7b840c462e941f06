"""Atomic writes (``pretrain.io``): a failure leaves the previous file as it was and is reported as
what the operating system refused, even when the writing library words it its own way."""

from __future__ import annotations

import errno
import resource

import pytest
import torch

from pretrain.errors import describe
from pretrain.io import atomic_write, staged_directory


def test_a_file_size_limit_met_inside_torch_save_keeps_the_old_file_and_names_the_fix(tmp_path):
    """torch.save reports a write refused by the file-size limit (``ulimit -f``, as a full disk) as a RuntimeError
    of its own ("unexpected pos ...", "iostream error"): before, a bug traceback; now one line, the previous
    checkpoint kept."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"the previous checkpoint")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        with pytest.raises(OSError) as raised:
            atomic_write(path, lambda tmp: torch.save(torch.zeros(1 << 19), tmp))  # 2 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG and raised.value.filename == str(path)
    assert path.read_bytes() == b"the previous checkpoint" and list(tmp_path.iterdir()) == [path]
    assert "raise the file-size limit (ulimit -f)" in describe(raised.value, "fit")


def test_a_file_size_limit_met_inside_safetensors_keeps_the_previous_export_and_names_the_fix(tmp_path):
    """An export (``staged_directory``) whose weights writer (safetensors: a ``SafetensorError`` of its own) meets
    the file-size limit: before, a bug traceback; now OSError naming the export directory, whose previous files
    are kept, and no staging directory left."""
    from safetensors.torch import save_file

    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError) as raised, staged_directory(out) as staging:
            save_file({"w": torch.zeros(1 << 19)}, str(staging / "model.safetensors"))  # 2 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG and raised.value.filename == str(out)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and [p.name for p in out.iterdir()] == [
        "config.json"
    ]
