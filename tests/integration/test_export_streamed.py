"""`pretrain export` / `pretrain convert --to hf` tensor by tensor (``pretrain.models.hf.save_hf_streamed``,
``pretrain.compat.hf_save``): every file byte for byte what the whole-model path (``load_model`` then ``save_hf``:
the model, its transformers copy, ``save_pretrained``) writes, for each family, and the peak memory one tensor's."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from model_zoo import VARIANTS
from training_utils import TINY_MODEL

from pretrain.checkpoint.convert import load_model
from pretrain.finetuning.export import export_checkpoint
from pretrain.models.config import ModelConfig
from pretrain.models.hf import save_hf
from pretrain.models.transformer import Transformer

SIZES = {"vocab_size": 97, "d_model": 36, "n_layer": 2, "n_head": 3, "d_ff": 50, "max_seq_len": 40}
ROPE = {"position": "rope", "norm": "rmsnorm", "norm_bias": False, "activation": "swiglu"}
ROPE |= {"attn_bias": False, "mlp_bias": False}
MODELS = {
    "gpt2": {"arch": "decoder"},
    "gpt2-untied": {"arch": "decoder", "tie_embeddings": False},
    "gpt2-bias-free": {"arch": "decoder", "attn_bias": False, "mlp_bias": False, "norm_bias": False},
    "llama": {"arch": "decoder", **ROPE, "n_kv_head": 1, "tie_embeddings": False},
    "llama-tied": {"arch": "decoder", **ROPE},
    "mistral": {"arch": "decoder", **ROPE, "attention_window": 8, "tie_embeddings": False},
    "bert": VARIANTS["bert"],
    "bert-untied": {**VARIANTS["bert"], "tie_embeddings": False},
    "bert-model": {**VARIANTS["bert"], "lm_head": False, "mlm_head_transform": False, "lm_head_bias": False}
    | {"pooler": True},
    "bigbird": {**VARIANTS["bert"], "pooler": True},
    "t5": {**VARIANTS["t5"], "head_dim": 12, "logit_scale": 36**-0.5},
    "t5-untied": TINY_MODEL["t5"],
    "modernbert": VARIANTS["modernbert"],
}
MUP = {
    "parametrization": "mup",
    "mup_base_width": 12,
}  # width_mult 3: the multipliers folded in (standard_equivalent)
MODELS |= {
    "mup-gpt2": MODELS["gpt2"] | MUP,  # the head untied: the embedding / 3
    "mup-gpt2-untied": MODELS["gpt2-untied"] | MUP | {"mup_attn_multiplier": 1.7},
    "mup-llama": MODELS["llama"] | MUP,
    "mup-bert": MODELS["bert"] | MUP,  # into the head transform's norm
    "mup-t5": MODELS["t5"] | MUP,  # tied: into the decoder's final norm
}


def checkpoint(path: Path, config: dict, tokenizer=None, dtype=torch.float32, ema: bool = False) -> Path:
    """A `pretrain fit` checkpoint file of a random model (weights perturbed: norms and biases not 1 or 0)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = {f"model.{k}": v.to(dtype) for k, v in model.state_dict().items()}
    if model.lm_head is not None and model.lm_head.weight is model.embed.tok.weight:
        state["model.lm_head.weight"] = state["model.embed.tok.weight"]  # tied: one storage, as saved
    special = {"eos": "<|endoftext|>"} if tokenizer is not None else {}
    payload = {
        "config": {"model": asdict(model.config), "tokenizer": {"special_tokens": special}},
        "tokenizer_json": tokenizer.to_str() if tokenizer is not None else None,
    }
    saved = {"state_dict": state, "pretrain": payload}
    if ema:
        saved["ema"] = {f"model.{k}": v.detach() * 0.5 for k, v in model.named_parameters()}
    torch.save(saved, path)
    return path


def whole_model_export(path: Path, out: Path, ema: bool = False) -> Path:
    """The export before streaming: the model loaded whole, then ``save_hf``."""
    model, info, tokenizer = load_model(path, ema=ema)
    special = info["config"]["tokenizer"]["special_tokens"]
    return save_hf(model, out, tokenizer, special)


def assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.mark.parametrize("name", list(MODELS))
def test_a_streamed_export_writes_the_whole_model_exports_bytes(name, tmp_path):
    path = checkpoint(tmp_path / "c.ckpt", SIZES | MODELS[name])
    assert_same_files(export_checkpoint(path, tmp_path / "new"), whole_model_export(path, tmp_path / "old"))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bfloat16_weights_a_tokenizer_and_the_ema_stream_as_they_exported(name, tokenizer, tmp_path):
    """bfloat16 weights cast to the model's float32 as ``load_state_dict`` casts them; the tokenizer's files and
    its ids in both configs; ``--ema``: the averages under every name of a tied parameter."""
    config = SIZES | MODELS[name]
    path = checkpoint(tmp_path / "c.ckpt", config, tokenizer, dtype=torch.bfloat16, ema=True)
    new = export_checkpoint(path, tmp_path / "new")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in new.iterdir()}
    assert_same_files(new, whole_model_export(path, tmp_path / "old"))
    ema = export_checkpoint(path, tmp_path / "new-ema", ema=True)
    assert_same_files(ema, whole_model_export(path, tmp_path / "old-ema", ema=True))
    assert (ema / "model.safetensors").read_bytes() != (new / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_sharded_export_writes_save_pretrained_s_shards_and_index(name, tmp_path, monkeypatch):
    """Over the shard size (50 GB; 20 kB here, for both paths) the shards and the index as ``save_pretrained``."""
    from pretrain.models import hf

    monkeypatch.setattr(hf, "_SHARD_BYTES", 20_000)
    path = checkpoint(tmp_path / "c.ckpt", SIZES | MODELS[name])
    new = export_checkpoint(path, tmp_path / "new")
    assert (new / "model.safetensors.index.json").is_file() and len(list(new.glob("model-*.safetensors"))) > 2
    assert_same_files(new, whole_model_export(path, tmp_path / "old"))
    assert hf.export_problem(new) is None


def test_the_safetensors_writer_writes_what_save_file_writes(tmp_path):
    """Mixed dtypes (the library orders by dtype, then name), a scalar, an empty tensor, a transposed one."""
    from safetensors.torch import save_file

    from pretrain.compat.hf_save import write_safetensors

    torch.manual_seed(0)
    tensors = {
        "b.weight": torch.randn(5, 7),
        "a.weight": torch.randn(3, 2).to(torch.bfloat16),
        "a.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "z.flag": torch.tensor([True, False, True]),
        "c.half": torch.randn(9).half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "é.t": torch.randn(4, 6).t(),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "lib.safetensors", {"format": "pt"})
    specs = {k: (v.shape, v.dtype) for k, v in tensors.items()}
    asked = []

    def produce(key):
        asked.append(key)
        return tensors[key]

    write_safetensors(tmp_path / "ours.safetensors", specs, produce, {"format": "pt"})
    assert sorted(asked) == sorted(tensors)  # each once
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()


def test_a_streamed_export_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Peak resident memory of the export (``VmHWM``, reset before it) above what the process held: under two of
    the largest tensor (8 MiB of a 31 MiB untied Llama: one tensor copied out of the mapped checkpoint, 1 MiB at a
    time here, each chunk's file pages released, then written; 11.3 MiB measured). The whole-model path held the
    model, its transformers copy and more: 47 MiB (``EXPORT=whole`` runs this measure on it: it fails)."""
    from pretrain.checkpoint import stream

    monkeypatch.setattr(stream, "_CHUNK", 1 << 20)  # below the tensor (16 MiB in use): one tensor, not two

    def resident_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))

    config = {**SIZES, **MODELS["llama"], "vocab_size": 8192, "d_model": 256, "n_head": 4, "d_ff": 1024}
    config |= {"n_layer": 4, "max_seq_len": 64}
    export_checkpoint(
        checkpoint(tmp_path / "warm.ckpt", SIZES | MODELS["llama"]), tmp_path / "warm"
    )  # imports
    path = checkpoint(tmp_path / "c.ckpt", config)
    largest = 8192 * 256 * 4 // 1024  # KiB
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = resident_kib("VmRSS")
    if os.environ.get("EXPORT") == "whole":
        whole_model_export(path, tmp_path / "hf")
    else:
        export_checkpoint(path, tmp_path / "hf")
    peak = resident_kib("VmHWM") - before
    assert peak < 2 * largest, f"{peak} KiB above {before} KiB (largest tensor {largest} KiB)"
