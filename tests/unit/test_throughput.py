"""The MFU peak table: a pure function of (device name, dtype), each listed device's datasheet figure (dense
tensor-core FLOP/s; the "with sparsity" figures halved), unknown devices give no number and a warning."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.training.callbacks.throughput import DENSE_PEAK_FLOPS, dtype_key, mfu_peak, peak_for

T = 1e12
# (torch.cuda.get_device_name, dense bf16, dense fp8 or None) from the vendors' datasheets
DATASHEET = [
    ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),  # SXM
    ("NVIDIA H100 PCIe", 756, 1513),
    ("NVIDIA H100 NVL", 835.5, 1670.5),
    ("NVIDIA H200", 989.4, 1978.9),
    ("NVIDIA A100-SXM4-40GB", 312, None),
    ("NVIDIA A100-SXM4-80GB", 312, None),
    ("NVIDIA A100 80GB PCIe", 312, None),
    ("NVIDIA B200", 2250, 4500),
    ("NVIDIA GB200", 2500, 5000),
    ("NVIDIA L4", 121, 242.5),
    ("NVIDIA L40S", 362.05, 733),
    ("NVIDIA A10", 125, None),
    ("NVIDIA GeForce RTX 4090", 165.2, 330.3),
    ("AMD Instinct MI300X", 1307.4, 2614.9),
]


@pytest.mark.parametrize(("name", "bf16", "fp8"), DATASHEET, ids=[row[0] for row in DATASHEET])
def test_every_listed_device_has_its_datasheet_peak_for_bf16_and_fp8_apart(name, bf16, fp8):
    assert peak_for(name, "bf16") == pytest.approx(bf16 * T)
    assert peak_for(name, "fp16") == pytest.approx(bf16 * T)  # one tensor-core rate for both halves
    assert peak_for(name, "fp8") == (None if fp8 is None else pytest.approx(fp8 * T))
    assert peak_for(name.upper(), "bf16") == peak_for(name, "bf16")  # case does not matter


def test_each_fragment_resolves_to_its_own_entry_so_the_order_is_right():
    """A fragment that is a substring of another device's name ("b200" in "gb200", "l4" in "l40s") would give
    that device the wrong peak if it came first."""
    for fragment, table in DENSE_PEAK_FLOPS:
        hit = next(t for f, t in DENSE_PEAK_FLOPS if f in f"nvidia {fragment} 80gb")
        assert hit is table, fragment


@pytest.mark.parametrize("name", ["NVIDIA Tesla T4", "NVIDIA RTX 6000 Ada Generation"])
def test_an_unknown_gpu_has_no_peak_and_mfu_warns_instead_of_guessing(name):
    assert peak_for(name, "bf16") is None
    with pytest.warns(UserWarning, match="MFU is not logged; set trainer.peak_flops") as record:
        assert mfu_peak(name, "bf16") is None
    assert len(record) == 1
    assert mfu_peak(name, "bf16", override=2e14) == 2e14  # trainer.peak_flops wins, silently


def test_a_cpu_has_no_peak_and_says_nothing(recwarn):
    assert mfu_peak("cpu", "fp32") is None and peak_for("cpu", "bf16") is None
    assert not [w for w in recwarn if "peak FLOP/s" in str(w.message)]


def test_a_dtype_the_device_lacks_has_no_peak():
    assert peak_for("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no fp8 tensor cores
    with pytest.raises(ValueError, match="dtype must be one of"):
        peak_for("NVIDIA H100", "int8")


def test_dtype_key_follows_precision_matmul_precision_and_float8():
    assert dtype_key(torch.bfloat16) == "bf16" and dtype_key(torch.float16) == "fp16"
    assert dtype_key(torch.bfloat16, float8=True) == "fp8"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert dtype_key(torch.float32) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert dtype_key(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_flops_per_token_is_torchtitans_6n_plus_12ldt_and_megatrons_halves_attention():
    """GPT-2 124M shape: ``flops_per_token`` equals torchtitan's formula on the parameter count (embeddings
    out, the tied LM head in); Megatron-LM's causal halving is 6.6 % lower at T = 1024 (the docstring's
    figure)."""
    cfg = ModelConfig(vocab_size=50257, d_model=768, n_layer=12, n_head=12, max_seq_len=2048)
    with torch.device("meta"):
        model = Transformer(cfg)
    for seq in (1024, 2048):
        n = model.num_params(exclude_embeddings=True) + cfg.vocab_size * cfg.d_model  # + tied head
        n -= sum(p.numel() for name, p in model.named_parameters() if "bias" in name or "norm" in name)
        titan = 6 * n + 12 * cfg.n_layer * cfg.d_model * seq
        assert model.flops_per_token(seq) == pytest.approx(titan)
        megatron = 6 * n + 6 * cfg.n_layer * cfg.d_model * seq
        lower = 1 - megatron / titan
        assert lower == pytest.approx({1024: 0.066, 2048: 0.117}[seq], abs=1e-3)
