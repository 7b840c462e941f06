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


def test_a_tensor_read_for_conversion_gives_its_memory_back_to_the_os_when_dropped():
    """``stream.unpooled``: a conversion's tensors live in mappings of their own, so the resident size falls back
    once each is written and dropped. From malloc (``torch.empty``), blocks under its mmap threshold (up to 32 MiB)
    freed below a later small allocation stay in its heap: this pattern kept 13-37 MiB."""
    from pretrain.checkpoint.stream import unpooled

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    # a freed 12 MiB block raises glibc's mmap threshold, as a conversion's first tensors do
    warm = torch.empty(3 << 20)
    warm.fill_(0)
    del warm
    before, kept = resident_mib(), []
    for mib in (4, 6, 8, 10, 12):  # growing tensors, each followed by a small allocation that outlives it
        tensor = unpooled(torch.Size([mib << 18]), torch.float32)
        tensor.fill_(1.0)
        kept.append(torch.ones(256))
        del tensor
    assert resident_mib() - before < 4
