"""Trainer assembly: strategies (DDP / FSDP / DeepSpeed ZeRO configs), precisions, loggers, callbacks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from pretrain import config
from pretrain.models.transformer import Block
from pretrain.training.checkpoint import AtomicCheckpointIO
from pretrain.training.preemption import LastCheckpoint
from pretrain.training.throughput import PeakThroughputMonitor
from pretrain.training.trainer import (
    build_loggers,
    build_strategy,
    build_trainer,
    deepspeed_config,
    wandb_mode,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GPT = REPO_ROOT / "recipes" / "gpt-tiny.yaml"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def load(*overrides: str, recipe: Path = GPT):
    return config.load(recipe, list(overrides))


def test_ddp_strategy():
    run, _ = load("strategy.name=ddp", "strategy.ddp.process_group_backend=gloo")
    strategy = build_strategy(run)
    assert isinstance(strategy, DDPStrategy) and isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    assert strategy._ddp_kwargs["find_unused_parameters"] is False
    assert strategy._process_group_backend == "gloo"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_strategy_wraps_blocks(checkpointing):
    from torch.distributed.fsdp import ShardingStrategy

    run, _ = load(
        "strategy.name=fsdp",
        "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP",
        f"trainer.activation_checkpointing={str(checkpointing).lower()}",
    )
    strategy = build_strategy(run, {Block})
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    assert strategy._state_dict_type == "sharded"
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert bool(strategy._activation_checkpointing_kwargs) is checkpointing


def test_fsdp_recipe_piece():
    run, _ = config.load(REPO_ROOT / "recipes" / "gpt2-350m.yaml")
    assert run.strategy.name == "fsdp" and run.strategy.fsdp.sharding_strategy == "FULL_SHARD"


@pytest.mark.parametrize(
    ("piece", "stage", "optimizer", "params"),
    [
        ("deepspeed_zero1", 1, False, False),
        ("deepspeed_zero2", 2, False, False),
        ("deepspeed_zero2_offload", 2, True, False),
        ("deepspeed_zero3", 3, False, False),
        ("deepspeed_zero3_offload", 3, True, True),
    ],
)
def test_deepspeed_configs(tmp_path, piece, stage, optimizer, params):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [model/gpt-tiny, strategy/{piece}]\n")
    run, _ = config.load(recipe)
    zero = deepspeed_config(run)["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) is optimizer and ("offload_param" in zero) is params
    if optimizer:
        assert zero["offload_optimizer"]["device"] == "cpu"


def test_bad_deepspeed_settings():
    run, _ = load(
        "strategy.name=deepspeed", "strategy.deepspeed.stage=1", "strategy.deepspeed.offload_optimizer=true"
    )
    with pytest.raises(ValueError, match="needs ZeRO stage 2 or 3"):
        deepspeed_config(run)
    run, _ = load(
        "strategy.name=deepspeed", "strategy.deepspeed.stage=2", "strategy.deepspeed.offload_parameters=true"
    )
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        deepspeed_config(run)
    with pytest.raises(ValueError, match="compile is not supported"):
        load("strategy.name=deepspeed", "trainer.compile=true")


@pytest.mark.skipif(HAS_DEEPSPEED, reason="checks the message shown when deepspeed is missing")
def test_deepspeed_without_the_package_is_a_clear_error():
    run, _ = load("strategy.name=deepspeed")
    with pytest.raises(ValueError, match="pip install"):
        build_strategy(run)


def test_wandb_is_offline_unless_configured(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, _ = load()
    assert wandb_mode(run) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(run) == "online"
    run, _ = load("logger.wandb.mode=offline")
    assert wandb_mode(run) == "offline"


def test_loggers(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, resolved = load(
        f"run_dir={tmp_path}", "logger.tensorboard=true", "logger.wandb.group=g", "logger.wandb.tags=[a,b]"
    )
    loggers = build_loggers(run, resolved, wandb_id="abcd1234")
    assert [type(x) for x in loggers] == [WandbLogger, CSVLogger, TensorBoardLogger]
    import os

    assert os.environ["WANDB_MODE"] in ("offline", "dryrun")  # Lightning spells offline "dryrun"
    wandb = loggers[0]
    assert wandb._experiment is None  # nothing starts before training
    assert wandb._wandb_init["config"] == resolved
    assert (
        wandb._id == "abcd1234"
        and wandb._wandb_init["group"] == "g"
        and wandb._wandb_init["tags"] == ["a", "b"]
    )
    assert wandb._wandb_init["name"] == "gpt-tiny"
    assert Path(loggers[1].log_dir).parent == tmp_path / "logs"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_trainer(tmp_path, precision):
    run, resolved = load(
        f"run_dir={tmp_path}",
        f"trainer.precision={precision}",
        "trainer.accumulate_grad_batches=4",
        "trainer.val_check_interval=50",
        "logger.wandb.enabled=false",
    )
    trainer = build_trainer(run, resolved)
    assert trainer.precision == ("bf16-mixed" if precision == "16-mixed" else precision)  # no fp16 AMP on CPU
    assert trainer.accumulate_grad_batches == 4
    assert trainer.val_check_interval == 200  # 50 optimizer steps = 200 micro-batches
    assert trainer.max_steps == run.trainer.max_steps
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    last = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    assert [(cb.path, cb.every_n_steps) for cb in last] == [
        (run.checkpoint_dir / "last.ckpt", run.checkpoint.every_n_steps)
    ]
    best = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert [cb.monitor for cb in best] == ["val/loss"]
    assert any(isinstance(cb, PeakThroughputMonitor) for cb in trainer.callbacks)


def test_outside_retention_names_only_best_checkpoints_the_callback_dropped(tmp_path):
    from types import SimpleNamespace

    from pretrain.training.trainer import outside_retention

    best = ModelCheckpoint(dirpath=tmp_path, filename="best-step{step}", monitor="val/loss", save_top_k=1)
    last = ModelCheckpoint(dirpath=tmp_path, filename="last", save_top_k=0, save_last=True)
    for name in ("best-step2.ckpt", "best-step4.ckpt", "last.ckpt", "notes.txt"):
        (tmp_path / name).write_text("x")
    best.best_k_models = {str(tmp_path / "best-step4.ckpt"): 1.0}  # step 2 was the k-th best, now dropped
    trainer = SimpleNamespace(checkpoint_callbacks=[best, last])
    assert outside_retention(trainer) == [tmp_path / "best-step2.ckpt"]
