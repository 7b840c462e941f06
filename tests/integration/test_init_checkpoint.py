"""``init.checkpoint``: a fresh `pretrain fit` run starts from another run's weights (context extension, continued
pretraining); a checkpoint whose weights do not fit the model, or that read another tokenizer, is refused in one
line before training."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, models
from training_utils import one_error_line

from pretrain.checkpoint import PAYLOAD, load_model
from pretrain.checkpoint.convert import initial_weights
from pretrain.config.run import load
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.training.setup import prepare_run

ROPE = {"vocab_size": 64, "d_model": 32, "n_layer": 2, "n_head": 2, "position": "rope", "max_seq_len": 128}


def test_a_fresh_run_starts_from_the_checkpoints_weights(tiny_gpt_run, tmp_path):
    ckpt = tiny_gpt_run["ckpt"]
    overrides = [f"run_dir={tmp_path / 'next'}", f"init.checkpoint={ckpt}", "model.dropout=0.2"]
    run, resolved = load(tiny_gpt_run["recipe"], overrides)
    module = prepare_run(run, resolved).module
    trained, _, _ = load_model(ckpt)
    expected = trained.state_dict()
    got = module.model.state_dict()
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert not torch.equal(
        Transformer(run.model).embed.tok.weight, got["embed.tok.weight"]
    )  # not a fresh init


def test_weights_of_another_shape_are_refused_in_one_line(capsys, tiny_gpt_run, tmp_path):
    line = one_error_line(
        capsys,
        "fit",
        tiny_gpt_run["recipe"],
        f"run_dir={tmp_path / 'next'}",
        f"init.checkpoint={tiny_gpt_run['ckpt']}",
        "model.d_model=48",
    )
    assert "holds weights of another model" in line and "model.d_model: checkpoint 32 vs config 48" in line
    assert not (tmp_path / "next" / "checkpoints").exists()


def test_rope_model_extends_its_context_and_the_tokenizer_must_match(tmp_path):
    """A rotary model's weights fit any max_seq_len and rope_scaling (the extension recipe's case)."""
    tok, other = (Tokenizer(models.WordLevel({w: 0}, unk_token=w)).to_str() for w in ("<unk>", "<other>"))
    trained = Transformer(ModelConfig(**ROPE))
    ckpt = tmp_path / "rope.ckpt"
    state = {f"model.{k}": v for k, v in trained.state_dict().items()}
    info = {"config": {"model": dataclasses.asdict(trained.config)}, "tokenizer_json": tok}
    torch.save({"state_dict": state, PAYLOAD: info}, ckpt)
    extended = ModelConfig(**ROPE | {"max_seq_len": 1024, "rope_scaling": {"type": "yarn", "factor": 8.0}})
    weights = initial_weights(ckpt, Transformer(extended), tok)
    assert all(torch.equal(weights[k], v) for k, v in trained.state_dict().items())
    with pytest.raises(ValueError, match="another tokenizer"):
        initial_weights(ckpt, Transformer(extended), other)
    with pytest.raises(ValueError, match="model.n_layer: checkpoint 2 vs config 3"):
        initial_weights(ckpt, Transformer(ModelConfig(**ROPE | {"n_layer": 3})), tok)
    with pytest.raises(FileNotFoundError, match="init.checkpoint"):
        initial_weights(tmp_path / "missing.ckpt", trained, tok)
