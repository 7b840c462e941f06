"""ModelConfig: defaults resolve, plain-dict / OmegaConf construction, every bad option names its field."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from pretrain.models.config import ModelConfig, Sizes


def test_defaults_resolve():
    c = ModelConfig(d_model=96, n_head=4, n_layer=3)
    assert (c.head_dim, c.n_kv_head, c.d_ff, c.n_decoder_layer) == (24, 4, 384, 3)
    assert c.sizes == Sizes(head_dim=24, n_kv_head=4, d_ff=384, n_decoder_layer=3)
    c = ModelConfig(d_model=96, n_head=4, n_kv_head=2, head_dim=10, d_ff=50, n_decoder_layer=1)
    assert (c.head_dim, c.n_kv_head, c.d_ff, c.n_decoder_layer) == (10, 2, 50, 1)
    assert c.sizes == Sizes(head_dim=10, n_kv_head=2, d_ff=50, n_decoder_layer=1)
    assert "sizes" not in dataclasses.asdict(c)  # a view, not a saved hyper-parameter
    c.d_ff = None  # unresolved after construction: an error, not None in model code
    with pytest.raises(ValueError, match="dataclasses.replace"):
        c.sizes  # noqa: B018
    assert dataclasses.replace(c).sizes.d_ff == 4 * 96


def test_plain_dict_and_omegaconf_round_trip():
    plain = {"arch": "encoder-decoder", "d_model": 64, "n_head": 4, "position": "relative"}
    c = ModelConfig(**plain)
    assert ModelConfig(**dataclasses.asdict(c)) == c
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"d_model": 64, "n_head": 2, "rope_theta": 500})
    built = OmegaConf.to_object(node)
    assert isinstance(built, ModelConfig) and built.head_dim == 32 and built.rope_theta == 500.0


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"arch": "seq2seq"}, "arch", "encoder-decoder"),
        ({"norm": "batchnorm"}, "norm", "rmsnorm"),
        ({"norm_position": "sandwich"}, "norm_position", "post"),
        ({"activation": "tanh"}, "activation", "swiglu"),
        ({"position": "alibi"}, "position", "rope"),
        ({"attn_scale": "sqrt"}, "attn_scale", "none"),
        ({"init": "xavier"}, "init", "t5"),
        ({"d_model": 100, "n_head": 3}, "d_model", "n_head"),
        ({"n_head": 6, "n_kv_head": 4}, "n_head", "n_kv_head"),
        ({"vocab_size": 0}, "vocab_size", "positive"),
        ({"n_layer": -1}, "n_layer", "positive"),
        ({"d_ff": 0}, "d_ff", "positive"),
        ({"position": "rope", "d_model": 30, "n_head": 2}, "head_dim", "even"),
        ({"norm": "rmsnorm"}, "norm_bias", "rmsnorm"),
        ({"dropout": 1.0}, "dropout", "[0, 1)"),
        ({"attn_dropout": -0.1}, "attn_dropout", "[0, 1)"),
        ({"norm_eps": 0.0}, "norm_eps", "> 0"),
        ({"logit_scale": 0.0}, "logit_scale", "> 0"),
        ({"pooler": True}, "pooler", "encoder"),
        ({"lm_head": False}, "lm_head", "encoder"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling", "position=rope"),
        ({"position": "rope", "rope_scaling": {"type": "ntk", "factor": 2.0}}, "rope_scaling.type", "yarn"),
        ({"position": "rope", "rope_scaling": {"type": "yarn"}}, "rope_scaling.factor", "required"),
        (
            {"position": "rope", "rope_scaling": {"type": "linear", "factor": 0.5}},
            "rope_scaling.factor",
            ">= 1",
        ),
        (
            {"position": "rope", "rope_scaling": {"type": "llama3", "factor": 8.0}},
            "rope_scaling.low_freq_factor",
            "required",
        ),
        (
            {"position": "rope", "rope_scaling": {"type": "linear", "factor": 2.0, "beta_fast": 8.0}},
            "rope_scaling.beta_fast",
            "not used by type 'linear'",
        ),
        (
            {"position": "rope", "rope_scaling": {"type": "yarn", "factr": 2.0}},
            "rope_scaling",
            "unknown keys",
        ),
    ],
)
def test_bad_option_names_field(overrides, field, allowed):
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig(**overrides)
    assert allowed in str(err.value)
    assert "ModelConfig." in str(err.value)


def test_rope_scaling_section_resolves_and_round_trips():
    c = ModelConfig(position="rope", max_seq_len=256, rope_scaling={"type": "yarn", "factor": 8.0})
    assert c.rope_scaling.original_max_seq_len == 256  # the context it was trained at, by default
    assert ModelConfig(**dataclasses.asdict(c)) == c
    node = OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {
            "position": "rope",
            "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
        },
    )
    assert OmegaConf.to_object(node).rope_scaling.high_freq_factor == 4.0


def test_properties():
    assert ModelConfig(activation="swiglu").gated and not ModelConfig(activation="gelu").gated
