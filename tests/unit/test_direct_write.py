"""``pretrain.checkpoint.direct_write``: DCP's files, byte for byte, written around the page cache and paced."""

from __future__ import annotations

import errno
import os
from contextlib import closing

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from pretrain.checkpoint import dcp as checkpoint_dcp
from pretrain.checkpoint import direct_write
from pretrain.checkpoint.direct_write import DirectStream, direct_writer

SMALL_CHUNK = 64 << 10  # many chunks from a few megabytes


def state() -> dict:
    torch.manual_seed(0)
    return {
        "big": torch.randn(700, 1000),  # 2.8 MB: dozens of chunks, not a multiple of one
        "ids": torch.arange(7),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "half": torch.randn(33, 5).to(torch.bfloat16),
        "nested": {"n": 3, "name": "x", "t": torch.randn(5)},
    }


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_the_files_are_dcps_own_byte_for_byte_and_read_back(tmp_path, monkeypatch, share):
    monkeypatch.setattr(direct_write, "CHUNK", SMALL_CHUNK)
    dcp.save(state(), storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    dcp.save(state(), storage_writer=direct_writer(tmp_path / "direct", share), no_dist=True)
    ours, theirs = tmp_path / "direct" / "__0_0.distcp", tmp_path / "dcp" / "__0_0.distcp"
    assert ours.read_bytes() == theirs.read_bytes()
    assert os.path.getsize(ours) % 4096 and os.path.getsize(ours) > 40 * SMALL_CHUNK  # truncated, many chunks
    read = checkpoint_dcp.read(tmp_path / "direct")
    expected = state()
    assert read["nested"]["n"] == 3 and read["nested"]["name"] == "x"
    for key in ("big", "ids", "scalar", "half"):
        assert torch.equal(read[key], expected[key]) and read[key].dtype == expected[key].dtype, key
    assert torch.equal(read["nested"]["t"], expected["nested"]["t"])


def test_the_bytes_go_around_the_page_cache(tmp_path, direct_io, resident_pages):
    """Written with O_DIRECT, a file leaves (nearly) none of its pages in the page cache; the same bytes written
    through it leave most of them there (what the measurement sees when it is there to see)."""
    data = os.urandom(16 << 20)
    with closing(DirectStream(tmp_path / "direct.bin")) as stream:
        stream.write(data)
        assert stream.direct
    with open(tmp_path / "buffered.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    direct, pages = resident_pages(tmp_path / "direct.bin")
    buffered, _ = resident_pages(tmp_path / "buffered.bin")
    assert buffered > pages // 2, (buffered, pages)
    assert direct < pages // 100, (direct, pages)
    assert (tmp_path / "direct.bin").read_bytes() == data  # (read last: reading fills the page cache)


def test_a_file_system_that_refuses_o_direct_gets_the_same_bytes_through_the_page_cache(
    tmp_path, monkeypatch
):
    """Refused at the open (tmpfs before Linux 6.6: EINVAL) or at the first write: the file is written all the same."""
    monkeypatch.setattr(direct_write, "CHUNK", SMALL_CHUNK)
    data = os.urandom(5 * SMALL_CHUNK + 123)
    real_open, real_pwrite = os.open, os.pwrite

    def open_refusing_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", open_refusing_direct)
        with closing(DirectStream(tmp_path / "at_open.bin")) as stream:
            stream.write(data)
        assert not stream.direct
    assert (tmp_path / "at_open.bin").read_bytes() == data

    refused = []

    def pwrite_refusing_once(fd, view, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, view, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_refusing_once)
    with closing(DirectStream(tmp_path / "at_write.bin")) as stream:
        stream.write(data[: SMALL_CHUNK // 2])
        stream.write(data[SMALL_CHUNK // 2 :])
    assert refused == [0] and not stream.direct
    assert (tmp_path / "at_write.bin").read_bytes() == data


def test_pacing_sleeps_so_the_writes_take_their_share_of_the_wall_clock(tmp_path, monkeypatch):
    """Each chunk is followed by a sleep of (1 / share - 1) times its write time: with share 0.25 the device is
    busy for a quarter of the write's wall time. (A fake clock: every pwrite takes 10 ms.)"""
    monkeypatch.setattr(direct_write, "CHUNK", SMALL_CHUNK)
    clock = [0.0]
    sleeps: list[float] = []
    real_pwrite = os.pwrite

    def timed_pwrite(fd, view, offset):
        clock[0] += 0.010
        return real_pwrite(fd, view, offset)

    monkeypatch.setattr(direct_write.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(direct_write.time, "sleep", sleeps.append)
    monkeypatch.setattr(os, "pwrite", timed_pwrite)
    with closing(DirectStream(tmp_path / "paced.bin", share=0.25)) as stream:
        stream.write(os.urandom(3 * SMALL_CHUNK + 10))
    assert sleeps == pytest.approx([0.030] * 4) and stream.paused == pytest.approx(0.120)
    writing = 4 * 0.010
    assert writing / (writing + sum(sleeps)) == pytest.approx(0.25)
    with closing(DirectStream(tmp_path / "unpaced.bin", share=1.0)) as stream:
        stream.write(os.urandom(3 * SMALL_CHUNK))
    assert len(sleeps) == 4 and stream.paused == 0


def test_a_share_outside_0_1_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\], got 0"):
        DirectStream(tmp_path / "x", share=0)
