"""`pretrain finetune` config: the Trainer sections of `pretrain fit` (strategy, logger, checkpoint, guards) and
LoRA are validated with one-line errors before anything is built."""

from __future__ import annotations

import pytest

from pretrain.finetuning.config import load_config, validate
from pretrain.models.config import BLOCK_LINEARS, ModelConfig
from pretrain.models.transformer import Transformer

BASE = {"init": {"checkpoint": "x.ckpt"}, "data": {"task": "sst2", "train_file": "train.tsv"}}


def cfg(**sections):
    return validate({**BASE, **sections})


def test_pretraining_sections_are_shared():
    c = cfg(strategy={"name": "fsdp"}, trainer={"accumulate_grad_batches": 2, "max_time_minutes": 5})
    assert c.strategy.fsdp.sharding_strategy == "FULL_SHARD" and c.trainer.max_time_minutes == 5
    assert c.trainer.limit_val_batches is None  # the whole file, unlike pretraining's default
    assert not c.logger.wandb.enabled and c.checkpoint.save_top_k == 0 and c.resume == "auto"
    assert str(c.checkpoint_dir).endswith("checkpoints")


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"trainer": {"compile": True}}, "trainer.compile is a `pretrain fit` option"),
        ({"trainer": {"accumulate_grad_batches": 0}}, "trainer.accumulate_grad_batches must be >= 1"),
        ({"trainer": {"precision": "fp8"}}, "trainer.precision"),
        ({"strategy": {"name": "deepspeed"}, "guards": {"spike": {"enabled": True}}}, "guards.spike"),
        ({"checkpoint": {"save_top_k": -2}}, "checkpoint.save_top_k must be >= -1"),
        ({"strategy": {"name": "fsdp", "tensor_parallel": 2}}, "finetuning runs data-parallel"),
        ({"lora": {"r": 0}}, "lora needs r >= 1"),
        ({"lora": {"target_modules": []}}, "lora.target_modules is empty"),
        ({"lora": {}, "freeze": {"layers": 1}}, "freeze does not apply with lora"),
        # bounds the datamodule and the decoder used to check under their Python names, after the backbone loaded
        ({"data": {**BASE["data"], "max_length": 1}}, "data.max_length must be >= 2"),
        ({"data": {**BASE["data"], "micro_batch_size": 0}}, "data.micro_batch_size must be >= 1"),
        ({"decoding": {"temperature": 0}}, r"decoding.temperature must be > 0"),
        ({"decoding": {"top_p": 1.5}}, r"decoding.top_p must be in \(0, 1\]"),
        ({"decoding": {"num_beams": 0}}, "decoding.num_beams must be >= 1"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\)"),
    ],
)
def test_bad_settings_fail_in_one_line(sections, message):
    with pytest.raises(ValueError, match=message):
        cfg(**sections)


def test_lora_targets_must_name_block_linears():
    from pretrain.finetuning.config import LoRAConfig
    from pretrain.finetuning.lora import add_lora

    model = Transformer(ModelConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, d_ff=32, max_seq_len=16))
    with pytest.raises(
        ValueError, match=r"lora.target_modules \['q_proj', 'qkv'\] name no linear.*choose from"
    ):
        add_lora(model, LoRAConfig(target_modules=["q", "qkv", "q_proj"]))


def test_lora_piece_composes(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "defaults: [lora/r8]\ninit: {checkpoint: x.ckpt}\ndata: {task: sst2, train_file: t.tsv}\n"
    )
    c = load_config(recipe)
    assert (c.lora.r, c.lora.alpha, c.lora.target_modules) == (8, 16, list(BLOCK_LINEARS))
