"""Trainer assembly: precisions, loggers, callbacks (strategies: test_strategies.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from pretrain import config
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.training.callbacks.preemption import LastCheckpoint
from pretrain.training.callbacks.throughput import PeakThroughputMonitor
from pretrain.training.trainer import StepWandbLogger, build_loggers, build_trainer, wandb_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
GPT = REPO_ROOT / "recipes" / "gpt-tiny.yaml"


def load(*overrides: str, recipe: Path = GPT):
    return config.load(recipe, list(overrides))


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
    assert [type(x) for x in loggers] == [StepWandbLogger, CSVLogger, TensorBoardLogger]
    assert isinstance(loggers[0], WandbLogger)
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
    assert (
        "anonymous" not in wandb._wandb_init
    )  # wandb printed "The anonymous setting has no effect" every run
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


def test_a_moved_run_directory_keeps_its_best_checkpoints_on_resume(tmp_path):
    """A run copied or moved to another directory and resumed: Lightning forgot the best-k record (the resumed
    run of `save_top_k: 1` kept a second "best" file and reported a worse checkpoint as its best); the record now
    follows the files by name, and one that is not in the new directory is dropped."""
    import torch

    from pretrain.training.trainer import build_callbacks

    run, _ = load(f"run_dir={tmp_path / 'new'}", "checkpoint.save_top_k=2")
    (best,) = [cb for cb in build_callbacks(run) if isinstance(cb, ModelCheckpoint)]
    old, new = tmp_path / "old" / "checkpoints", Path(best.dirpath)
    new.mkdir(parents=True)
    for name in ("best-step2.ckpt", "best-step4.ckpt"):
        (new / name).write_text("x")
    scores = {"best-step2.ckpt": 6.5, "best-step4.ckpt": 6.7, "best-step6.ckpt": 6.4}  # step 6: not copied
    written = ModelCheckpoint(dirpath=old, monitor="val/loss", save_top_k=2)
    assert best.state_key == written.state_key  # the record of a checkpoint Lightning's own callback wrote
    saved = written.state_dict()
    saved.update(
        best_k_models={str(old / n): torch.tensor(s) for n, s in scores.items()},
        best_model_path=str(old / "best-step6.ckpt"),
        best_model_score=torch.tensor(6.4),
        kth_best_model_path=str(old / "best-step4.ckpt"),
        kth_value=torch.tensor(6.7),
    )
    with pytest.warns(UserWarning, match="1 best checkpoint"):
        best.load_state_dict(saved)
    assert {Path(p).name: float(s) for p, s in best.best_k_models.items()} == pytest.approx(
        {"best-step2.ckpt": 6.5, "best-step4.ckpt": 6.7}
    )
    assert (best.best_model_path, float(best.best_model_score)) == (str(new / "best-step2.ckpt"), 6.5)
    assert (best.kth_best_model_path, float(best.kth_value)) == (
        str(new / "best-step4.ckpt"),
        pytest.approx(6.7),
    )
