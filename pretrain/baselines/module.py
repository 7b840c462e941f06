"""The LightningModule every baseline shares (summable loss / targets / correct counts per batch, the run's
AdamW + schedule) and the Trainer fit through ``pretrain.training.trainer.build_trainer``."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from pretrain.config import OptimConfig, RunConfig
from pretrain.errors import InputError
from pretrain.objectives.base import summarize_sums
from pretrain.objectives.loss import IGNORE_INDEX, token_cross_entropy
from pretrain.optim import build_optimizer, build_scheduler
from pretrain.training.step import FreeGradientsAfterStep, StepLossHooks


class BaselineModule(StepLossHooks, FreeGradientsAfterStep, L.LightningModule):
    """A model and a loss giving summable ``loss_sum``, ``num_targets`` (and ``num_correct``) per batch; the mean
    loss of each batch is minimised with the run's AdamW + schedule (``pretrain.optim``). Logs ``train/*`` and
    ``val/*`` (loss, accuracy, perplexity for token-prediction models)."""

    reports_perplexity = False

    def __init__(self, model: nn.Module, optim: OptimConfig, max_steps: int, objective: Any = None):
        super().__init__()
        self.model, self.optim, self.max_steps, self.objective = model, optim, max_steps, objective
        self.flops_per_batch: float | None = None  # read by the ThroughputMonitor
        self.recipe: dict[str, Any] | None = None  # ``resume_settings``, saved in every checkpoint (``fit``)
        self._val_sums: dict[str, Tensor] = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.recipe is not None:
            checkpoint[SETTINGS_KEY] = self.recipe

    def on_train_start(self) -> None:
        self.start_step_loss()

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        raise NotImplementedError

    def _metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Loss / accuracy / perplexity from the summed counts (as an objective's ``summarize``)."""
        metrics = summarize_sums({"num_correct": 0, **sums}, self.reports_perplexity)
        return metrics if "num_correct" in sums else {k: v for k, v in metrics.items() if k != "accuracy"}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        sums = self.sums(batch, training=True)
        metrics = self._metrics({k: v.detach().float() for k, v in sums.items()})
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False)
        scheduler = self.lr_schedulers()
        assert isinstance(scheduler, LRScheduler)  # configure_optimizers's one
        self.log("train/lr", scheduler.get_last_lr()[0], on_step=True, on_epoch=False)
        return self.step_mean(sums["loss_sum"] / sums["num_targets"].clamp_min(1), batch_idx)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        for key, value in self.sums(batch, training=False).items():
            self._val_sums[key] = self._val_sums.get(key, 0) + value.detach().float()

    def on_validation_epoch_end(self) -> None:
        if self._val_sums:
            metrics = self._metrics(self._val_sums)
            self.log_dict({f"val/{k}": v for k, v in metrics.items()}, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = build_optimizer(self.model, self.optim)
        scheduler = build_scheduler(optimizer, self.optim, self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_sums(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Summed token cross-entropy, number of targets and of correct argmax predictions (labels -100 ignored)."""
    loss_sum, num_targets = token_cross_entropy(logits, labels)
    correct = ((logits.detach().argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
    return {"loss_sum": loss_sum, "num_targets": num_targets, "num_correct": correct}


def fit(
    run: RunConfig, resolved: dict[str, Any], module: BaselineModule, datamodule: L.LightningDataModule
) -> L.Trainer:
    """Build the run's Trainer (``pretrain.training.trainer.build_trainer``) and fit ``module``, resuming as
    ``run.resume`` says (``auto``: the run's newest valid checkpoint). A resume restores weights, optimizer and
    step; the data position exactly where the datamodule keeps a state (SGNS's ``PretrainDataModule``), else the
    data order restarts at its beginning."""
    from pretrain.checkpoint import read
    from pretrain.training.setup import resume_path
    from pretrain.training.trainer import build_trainer

    ckpt = resume_path(run)
    module.recipe = resume_settings(resolved)
    if ckpt is not None:
        saved = read(ckpt, mmap=True)
        check_same_model(saved.get("state_dict", {}), module.state_dict(), ckpt)
        check_same_settings(saved.get(SETTINGS_KEY), module.recipe, ckpt)
    trainer = build_trainer(run, resolved)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    return trainer


SETTINGS_KEY = (
    "baseline_settings"  # in every baseline checkpoint: what a resume must keep (``resume_settings``)
)
# how a run executes and records, free to change on a resume (the rest gives the checkpoint's state its meaning)
# (and where the raw text lies: the prepared data and the tokenizer file stand for it)
FREE = (
    "name",
    "run_dir",
    "resume",
    "resume_allow",
    "trainer",
    "logger",
    "checkpoint",
    "data.num_workers",
    "tokenizer.train_files",
)


def resume_settings(resolved: dict[str, Any]) -> dict[str, Any]:
    """The recipe's settings a resume compares (flattened, ``FREE`` left out), with the learning-rate schedule's
    length as it takes effect (``optim.decay_steps``, by default ``trainer.max_steps``)."""

    def flat(node: Any, prefix: str) -> dict[str, Any]:
        if not isinstance(node, dict):
            return {prefix: node}
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    values = {k.rstrip("."): v for k, v in flat(resolved, "").items()}
    kept = {k: v for k, v in values.items() if not any(k == f or k.startswith(f + ".") for f in FREE)}
    if isinstance(kept.get("data.sources"), list):
        kept["data.sources"] = [
            {k: v for k, v in source.items() if k != "text"} if isinstance(source, dict) else source
            for source in kept["data.sources"]
        ]
    optim = resolved.get("optim") or {}
    kept["optim.decay_steps"] = optim.get("decay_steps") or (resolved.get("trainer") or {}).get("max_steps")
    return kept


def check_same_settings(saved: dict[str, Any] | None, current: dict[str, Any], path: Any) -> None:
    """``InputError`` naming every setting of ``current`` that differs from the checkpoint's (``saved``; None for
    a checkpoint written before they were recorded): before, a baseline resumed under another learning rate,
    window or number of negatives without a word (the optimizer state kept the old rate)."""
    if saved is None:
        return
    differ = [
        f"{key}: checkpoint {saved.get(key)!r} vs config {current.get(key)!r}"
        for key in sorted(saved.keys() | current.keys())
        if saved.get(key) != current.get(key)
    ]
    if differ:
        raise InputError(
            f"cannot resume {path}: {'; '.join(differ)}; resume with the checkpoint's settings, or start a new run "
            "(name=NEW or resume=null)"
        )


def check_same_model(saved: dict[str, Tensor], current: dict[str, Tensor], path: Any) -> None:
    """``ValueError`` when checkpoint weights ``saved`` do not fit the configured model (names or shapes)."""
    differ = sorted(
        k
        for k in saved.keys() | current.keys()
        if k not in saved or k not in current or saved[k].shape != current[k].shape
    )
    if differ:
        raise InputError(
            f"checkpoint {path} holds another model ({len(differ)} weights differ, e.g. {differ[0]}); resume with "
            f"the recipe it was trained with, or start fresh (resume=null, or another name)"
        )


def val_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The last logged ``val/*`` metrics of a fit, as floats."""
    return {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}
