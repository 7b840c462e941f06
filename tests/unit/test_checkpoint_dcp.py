"""Reading torch.distributed.checkpoint directories (``pretrain.checkpoint.dcp``): the same tensors and
structure as torch's own ``dcp_to_torch_save``, and no code run from a directory's metadata or items."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.checkpoint import dcp

RAN: list[str] = []


class Payload:
    """Records that it was unpickled (as a hostile object would run code)."""

    def __reduce__(self):
        return (RAN.append, ("unpickled",))


def state() -> dict:
    weights = {"model.a.weight": torch.randn(3, 4), "model.b": torch.arange(5.0)}
    moments = {
        name: {"step": torch.tensor(2.0), "exp_avg": torch.randn_like(t)} for name, t in weights.items()
    }
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "name": "decay", "params": ["model.a.weight", "model.b"]}]
    return {"state_dict": weights, "optimizer_0": {"state": moments, "param_groups": groups}}


def assert_same(a, b) -> None:
    """Equal structure, tensors bitwise equal (dtype included), other leaves ``==``."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_read_equals_torchs_own_conversion(tmp_path):
    torch_dcp.save(state(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    reference = torch.load(tmp_path / "full.pt", weights_only=True)
    ours = dcp.read(tmp_path / "ckpt")
    assert list(ours) == list(reference)
    assert_same(ours, reference)
    only = dcp.read(tmp_path / "ckpt", select=lambda k: k.startswith("state_dict."))
    assert list(only) == ["state_dict"]


def test_load_fills_a_nested_template_in_place(tmp_path):
    saved = state()
    torch_dcp.save(saved, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    template = state()
    weight = template["state_dict"]["model.a.weight"]
    template["optimizer_0"]["param_groups"][0]["lr"] = 0.5
    dcp.load(template, tmp_path / "ckpt")
    assert template["state_dict"]["model.a.weight"] is weight and torch.equal(
        weight, saved["state_dict"]["model.a.weight"]
    )
    assert template["optimizer_0"]["param_groups"][0]["lr"] == 0.1


def test_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path):
    torch_dcp.save(state(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(
        ValueError, match=r"unreadable DCP metadata .*builtins\.list\.append|unreadable DCP metadata"
    ):
        dcp.read(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps({"x": os.system}))
    with pytest.raises(ValueError, match=r"refers to (posix|os|nt)\.system"):
        dcp.metadata(tmp_path / "ckpt")
    assert RAN == []


def test_an_item_holding_an_object_is_not_unpickled(tmp_path):
    torch_dcp.save({"x": torch.ones(2), "hostile": Payload()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with pytest.raises(ValueError, match="holds objects other than tensors and plain containers"):
        dcp.read(tmp_path / "ckpt")
    assert RAN == []


def file_checkpoint(path, mib: int = 4, layers: int = 4) -> None:
    """A checkpoint file of ``layers`` tensors of ``mib`` MiB with a moment each, a transposed one and a tied one."""
    rows = mib << 8
    weights = {f"model.w{i}": torch.randn(rows, 1024) for i in range(layers)}
    weights["model.t"] = torch.randn(64, 32).t()  # a transposed view: written with its strides
    weights["model.tied"] = weights["model.w0"]
    moments = {n: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(t)} for n, t in weights.items()}
    groups = [{"lr": 1.0, "params": list(weights)}]
    optimizer = {"state": moments, "param_groups": groups}
    torch.save({"global_step": 3, "state_dict": weights, "optimizer_states": [optimizer]}, path)


def test_a_file_converted_to_dcp_writes_what_dcp_writes_for_its_mapped_tensors(tmp_path):
    """``pretrain convert FILE --to dcp`` copies each tensor out of the file's mapping (pages released): the shard
    file and ``meta.pt`` are byte for byte what DCP writes for the mapped tensors themselves (the path before);
    ``.metadata`` equal but for its ``storage_meta`` (the temporary directory and fresh ids of every save)."""
    from pretrain.checkpoint.stream import convert, open_source, write_dcp

    file_checkpoint(tmp_path / "f.ckpt", mib=1, layers=2)
    convert(tmp_path / "f.ckpt", "dcp", tmp_path / "new")
    with open_source(tmp_path / "f.ckpt") as source:
        source.loadable = set()  # before: DCP writes the mapped tensors, their pages resident
        write_dcp(source, tmp_path / "old")
    files = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "new").iterdir())
    for name in files:
        if name != ".metadata":
            assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    old, new = dcp.metadata(tmp_path / "old"), dcp.metadata(tmp_path / "new")
    assert old.state_dict_metadata == new.state_dict_metadata
    assert old.storage_data == new.storage_data and old.planner_data == new.planner_data


def test_a_file_converted_to_dcp_keeps_one_tensors_pages_at_a_time(tmp_path, monkeypatch):
    """Each tensor is copied out of the file's mapping 16 MiB at a time, the mapping's pages released as they
    are copied: after every tensor read, under 1 MiB of the file's 128 MiB is resident (before: every page the writer had
    read stayed, the whole file at the end), and the process's resident size grows by at most 2 tensors."""
    from pretrain.checkpoint import stream

    file_checkpoint(tmp_path / "f.ckpt", mib=8, layers=4)  # 8 tensors of 8 MiB: 64 MiB of tensors

    def resident_kib(file=None):
        if file is None:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
        total, ours = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and not head[0].endswith(":"):
                    ours = len(head) >= 6 and head[-1] == str(file)
                elif ours and head[0] == "Rss:":
                    total += int(head[1])
        return total

    mapped, process, copied = [], [], stream.released_copy

    def recorded(tensor):
        out = copied(tensor)
        mapped.append(resident_kib(tmp_path / "f.ckpt"))
        process.append(resident_kib())
        return out

    monkeypatch.setattr(stream, "released_copy", recorded)
    before = resident_kib()
    stream.convert(tmp_path / "f.ckpt", "dcp", tmp_path / "dcp")
    assert len(mapped) == 18, mapped  # 4 weights, the transposed and tied ones, a moment and a step each
    assert max(mapped) < 1024, mapped  # KiB: the pickle's pages, the kernel's fault-around (64 KiB) of a read
    assert max(process) - before < 2 * 8 * 1024 + 4096
