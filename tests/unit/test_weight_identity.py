"""What identifies a model's weights (``ModelConfig.identity``) apart from its run-time settings: a run-time field
changes neither the parameters nor the function they compute, so a checkpoint resumes under it; any other field
is a different model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.checkpoint.resume import check_compatible
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

BASE = ModelConfig(
    arch="encoder-decoder", vocab_size=64, d_model=32, n_layer=1, n_head=2, d_ff=64, max_seq_len=32, init="t5"
)
CHANGED = {
    "attention": "flex",
    "dropout": 0.1,
    "attn_dropout": 0.1,
    "init": "bert",
    "init_std": 0.05,
    "zero_init_projections": True,
    "pad_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}


def test_every_run_time_field_is_exercised():
    assert set(CHANGED) == ModelConfig.RUN_TIME


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_a_run_time_setting_keeps_weights_and_function_and_may_resume(name):
    other = dataclasses.replace(BASE, **{name: CHANGED[name]})
    check_compatible(dataclasses.asdict(BASE), dataclasses.asdict(other), "x.ckpt")
    torch.manual_seed(0)
    saved, resumed = Transformer(BASE).eval(), Transformer(other).eval()
    resumed.load_state_dict(saved.state_dict())  # strict: the same parameter names and shapes
    if name == "attention":
        return  # flex == sdpa on the same weights: test_attention.py (each compile here costs ~30 s on a CPU)
    ids = torch.randint(4, 64, (2, 16))
    start = torch.zeros(2, 1, dtype=torch.long)
    decoder = torch.cat([start, ids[:, :7]], dim=1)
    with torch.no_grad():
        a = saved(ids, decoder_input_ids=decoder).logits
        b = resumed(ids, decoder_input_ids=decoder).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("d_model", 64),
        ("activation", "swiglu"),
        ("attention_window", 8),
        ("position", "rope"),
        ("vocab_size", 128),
    ],
)
def test_a_field_of_the_weights_identity_is_another_model(name, value):
    other = dataclasses.asdict(dataclasses.replace(BASE, **{name: value}))
    with pytest.raises(ValueError, match=rf"different model \(model\.{name}: checkpoint"):
        check_compatible(dataclasses.asdict(BASE), other, "x.ckpt")


def test_set_attention_leaves_the_callers_config_alone():
    config = dataclasses.replace(BASE)
    model = Transformer(config).set_attention("flex")
    assert config.attention == "sdpa" and model.config.attention == "flex"
