"""Per-step timing shared by ``bench_step_overhead.py`` and ``bench_lightning_overhead.py``: the same recipe trained
by ``Trainer.fit`` as ``pretrain fit`` runs it (callbacks, guards, loggers) and by a plain PyTorch loop (forward,
sum of token losses / targets, backward, clip, fused AdamW, schedule) over the same model, objective and batches.
Each records (wall, CPU, page faults) after every optimizer step; ``rate`` turns them into seconds per step after
``WARMUP`` steps (allocator warm-up, first-call costs)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from pretrain.compat import lightning as lightning_compat  # noqa: F401  (first: Lightning imported as pretrain fit does)

# isort: split
import lightning
import torch
from lightning.pytorch.callbacks import Callback

from pretrain import config
from pretrain.optim import build_optimizer, build_scheduler
from pretrain.training.module import STEP_TARGETS
from pretrain.training.setup import build_data, prepare_run
from pretrain.training.step import FreeGradientsAfterStep
from pretrain.training.trainer import build_loggers, build_trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"
RECIPE = REPO_ROOT / "recipes" / "gpt-tiny.yaml"
WARMUP = 5  # steps excluded from the timing

Clock = tuple[
    float, float, int
]  # (wall seconds, process CPU seconds, minor page faults of the process so far)


def now() -> Clock:
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rate(times: list[Clock]) -> tuple[float, float]:
    """(wall seconds per step, CPU seconds per step) after the warm-up steps."""
    n = len(times) - 1 - WARMUP
    return (times[-1][0] - times[WARMUP][0]) / n, (times[-1][1] - times[WARMUP][1]) / n


def faults_per_step(times: list[Clock]) -> float:
    """Minor page faults per step after the warm-up steps (memory the OS maps in again, a page at a time)."""
    return (times[-1][2] - times[WARMUP][2]) / (len(times) - 1 - WARMUP)


def prepare_corpus(work: Path) -> None:
    """A 1024-token BPE tokenizer and token shards (5 % validation) of the shipped Tiny Shakespeare in ``work``."""
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import train_bpe

    train_bpe([CORPUS], 1024, work / "tokenizer.json", min_frequency=2, show_progress=False)
    prepare([CORPUS], work / "tokenizer.json", work / "data", val_fraction=0.05, progress=False)


def corpus_overrides(work: Path, tag: str) -> list[str]:
    """The recipe on ``prepare_corpus``'s data, a fresh run directory, W&B off."""
    return [
        f"tokenizer.path={work / 'tokenizer.json'}",
        f"data.sources.0.prepared={work / 'data'}",
        f"run_dir={work / tag}",
        "resume=null",
        "logger.wandb.enabled=false",
    ]


class StepClock(Callback):
    """Clocks at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[Clock] = []
        self._step = -1

    def on_train_batch_end(self, trainer, *_) -> None:
        if trainer.global_step != self._step:  # a micro-batch within an accumulated step
            self._step = trainer.global_step
            self.times.append(now())


def fit_clocks(overrides: list[str], profiler=None) -> list[Clock]:
    """``Trainer.fit`` of ``RECIPE`` with everything ``pretrain fit`` builds (loggers included)."""
    run, resolved = config.load(RECIPE, overrides)
    parts = prepare_run(run, resolved)
    clock = StepClock()
    trainer = build_trainer(run, resolved, callbacks=[clock], loggers=build_loggers(run, resolved, None))
    if profiler is not None:
        trainer.profiler = profiler
    trainer.fit(parts.module, datamodule=parts.datamodule)
    return clock.times


def plain_clocks(overrides: list[str]) -> list[Clock]:
    """The same steps by hand, over the same model (same initial weights), objective and batches."""
    run, resolved = config.load(RECIPE, overrides)
    parts = prepare_run(run, resolved)
    model, objective = parts.module.model, parts.module.objective
    optimizer = build_optimizer(model, run.optim)
    scheduler = build_scheduler(optimizer, run.optim, run.trainer.max_steps)
    data = build_data(run, objective, parts.tokenizer)
    data.setup("fit")
    model.train()
    times = []
    for step, batch in enumerate(data.train_dataloader()):
        if step == run.trainer.max_steps:
            break
        batch = data.on_before_batch_transfer(batch, 0)  # as under Lightning: all-ones masks dropped
        batch.pop(STEP_TARGETS)
        labels = batch.pop("labels")
        loss_sum, n = objective.loss(model(**batch).logits, labels)
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        times.append(now())
    return times


class _MinimalModule(lightning.LightningModule):
    """The plain loop's step as a LightningModule: Lightning's automatic optimisation and nothing of ours."""

    def __init__(self, model: torch.nn.Module, objective, run) -> None:
        super().__init__()
        self.model, self.objective, self.run = model, objective, run

    def training_step(self, batch: dict, batch_idx: int):
        batch.pop(STEP_TARGETS)
        labels = batch.pop("labels")
        loss_sum, n = self.objective.loss(self.model(**batch).logits, labels)
        return loss_sum / n

    def configure_gradient_clipping(self, optimizer, *args, **kwargs) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.run.trainer.gradient_clip_val)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.run.optim)
        scheduler = build_scheduler(optimizer, self.run.optim, self.run.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _MinimalFreeingModule(FreeGradientsAfterStep, _MinimalModule):
    """``_MinimalModule`` with the gradients freed right after each update, as ``PretrainModule`` does."""


def lightning_clocks(overrides: list[str], free_gradients: bool = False) -> list[Clock]:
    """The plain loop's step under a bare ``lightning.Trainer`` (no callbacks, logger, checkpoints or progress
    output): what Lightning's loop costs by itself, over the same model (same initial weights) and batches; with
    ``free_gradients``, in ``PretrainModule``'s gradient order instead of Lightning's."""
    run, resolved = config.load(RECIPE, overrides)
    parts = prepare_run(run, resolved)
    cls = _MinimalFreeingModule if free_gradients else _MinimalModule
    module = cls(parts.module.model, parts.module.objective, run)
    clock = StepClock()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=run.trainer.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=build_data(run, parts.module.objective, parts.tokenizer))
    return clock.times
