"""The Lightning Trainer of a run: strategy (``strategies.py``), precision, loggers and callbacks."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from pretrain import compat
from pretrain.checkpoint.async_save import AsyncCheckpointIO
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.compat import lightning as lightning_compat
from pretrain.config.run import RunConfig, TrainingRun, check_checkpoint, is_precision
from pretrain.training.callbacks.best import BestCheckpoints
from pretrain.training.callbacks.garbage import ScheduledGarbageCollection
from pretrain.training.callbacks.guards import StepGuard, build_guards
from pretrain.training.callbacks.host_sync import SyncCheck, allowed
from pretrain.training.callbacks.preemption import LastCheckpoint
from pretrain.training.callbacks.progress import progress_callbacks
from pretrain.training.callbacks.throughput import PeakThroughputMonitor
from pretrain.training.host_memory import reuse_freed_memory
from pretrain.training.quiet import quiet_libraries
from pretrain.training.step import micro_batches
from pretrain.training.strategies import build_strategy, checkpoint_io


def wandb_mode(run: TrainingRun) -> str:
    """``online`` only when configured (logger.wandb.mode=online, WANDB_MODE, or an API key); else ``offline``."""
    return (
        run.logger.wandb.mode
        or os.environ.get("WANDB_MODE")
        or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    )


class StepWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` on the run's step numbering: W&B's own step is the step the metrics are logged
    at (``wandb.log(step=...)``; Lightning lets W&B count its calls instead), the step of the CSV log, the
    progress lines and the checkpoint names, so a resumed run's history continues the run's step axis (an
    offline launch no longer starts its history at 0). W&B cannot rewind a run's history (its rewind is a
    private preview), so a step an earlier launch has sent already -- a resume from a checkpoint older than the
    run's last logged step -- is not sent again: ``steps_file`` keeps the newest step each run id has sent
    (offline runs cannot ask W&B), and one warning says which steps only the other loggers (CSV) hold."""

    def __init__(self, steps_file: Path, **kwargs: Any):
        super().__init__(**kwargs)
        lightning_compat.without_anonymous(self)  # a library notice on every run
        self.steps_file = steps_file
        self._floor: int | None = None  # steps below it were sent by earlier launches of this run
        self._skipped: list[int] = []

    def _sent(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads(self.steps_file.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if step is None or self._prefix:
            return super().log_metrics(metrics, step)
        run = self.experiment
        if self._floor is None:  # once per launch: what the run holds already
            self._floor = max(int(run.step), self._sent().get(run.id, -1) + 1)
        if step < self._floor:
            if not self._skipped:
                warnings.warn(
                    f"W&B run {run.id} holds steps up to {self._floor - 1} from an earlier launch (this one resumed "
                    f"from an older checkpoint; W&B cannot rewind a run): steps {step}-{self._floor - 1} of this "
                    "launch are logged to the other loggers (CSV) only",
                    stacklevel=2,
                )
            self._skipped.append(step)
            return
        run.log({**metrics, "trainer/global_step": step}, step=step)
        sent = self._sent()
        if sent.get(run.id, -1) < step:  # a hint, replaced whole (no fsync: a lost update re-sends one step)
            self.steps_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.steps_file.with_name(f".{self.steps_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**sent, run.id: step}))
            os.replace(tmp, self.steps_file)


def build_loggers(run: TrainingRun, resolved: dict[str, Any], wandb_id: str | None) -> list[Logger]:
    """W&B (offline by default; ``wandb_id`` continues a run), CSV and TensorBoard under ``run.run_dir``."""
    out = run.run_path
    loggers: list[Logger] = []
    cfg = run.logger
    if cfg.wandb.enabled:
        mode = wandb_mode(run)
        os.environ["WANDB_MODE"] = mode  # no network and no account needed unless the user asks for it
        out.mkdir(parents=True, exist_ok=True)
        logger = StepWandbLogger(
            out / "wandb" / "last-steps.json",
            project=cfg.wandb.project,
            name=cfg.wandb.name or run.name,
            group=cfg.wandb.group,
            tags=list(cfg.wandb.tags),
            save_dir=str(out),
            id=wandb_id,
            offline=mode == "offline",
            resume="allow",
            config=resolved,  # wandb.init(config=...): the run's config panel
        )
        loggers.append(logger)
    if cfg.csv:
        loggers.append(CSVLogger(save_dir=str(out), name="logs"))
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(save_dir=str(out), name="tensorboard"))
    for other in loggers[1 if cfg.wandb.enabled else 0 :]:
        other.log_hyperparams(resolved)  # hparams.yaml next to the metrics
    return loggers


def build_callbacks(run: TrainingRun) -> list[Callback]:
    """``last.ckpt`` every ``checkpoint.every_n_steps`` steps, at the end and on a stop signal; the best k by
    validation loss; throughput/MFU; the guards of ``run.guards``; the host-sync check of ``trainer.sync_check``;
    the garbage-collection schedule of ``trainer.gc_every_n_steps``; evaluation during fit (``run.eval_during_fit``)."""
    directory = run.checkpoint_dir
    k = run.trainer.accumulate_grad_batches
    callbacks: list[Callback] = [
        PeakThroughputMonitor(
            batch_size_fn=lambda batch: batch["input_ids"].shape[0],
            length_fn=lambda batch: batch["input_ids"].numel(),
            window_size=max(2, micro_batches(run.trainer.throughput_window, k)),
            peak=run.trainer.peak_flops,
            float8=run.trainer.float8,
        ),
        *build_guards(run),
    ]
    if run.trainer.sync_check != "off":
        callbacks.append(SyncCheck(run.trainer.sync_check))
    if run.trainer.gc_every_n_steps:
        callbacks.append(ScheduledGarbageCollection(run.trainer.gc_every_n_steps))
    if isinstance(run, RunConfig) and run.eval_during_fit.tasks:  # a RunConfig section only
        from pretrain.training.callbacks.in_loop_eval import InLoopEvaluation

        callbacks.append(InLoopEvaluation(run.eval_during_fit, run.tokenizer.special_tokens))
    ema = getattr(run, "ema", None)  # a RunConfig section only
    if ema is not None and ema.decay is not None:
        from pretrain.training.callbacks.ema import EMA

        callbacks.append(EMA(ema.decay, ema.every_n_steps, ema.start_step))
    if run.checkpoint.save_top_k != 0:
        check_checkpoint(
            run.checkpoint
        )  # sets an unset mode from the metric's name (fit's set-up did already)
        assert run.checkpoint.mode is not None  # set by check_checkpoint
        leaf = run.checkpoint.monitor.rsplit("/", 1)[-1]
        callbacks.append(
            BestCheckpoints(
                dirpath=directory,
                filename=f"best-step{{step}}-{leaf}{{{run.checkpoint.monitor}:.4f}}",
                auto_insert_metric_name=False,
                monitor=run.checkpoint.monitor,
                mode=run.checkpoint.mode,
                save_top_k=run.checkpoint.save_top_k,
            )
        )
    # last: after a validation it saves once the best-k callback has recorded that validation
    callbacks.append(LastCheckpoint(directory / "last.ckpt", run.checkpoint.every_n_steps))
    return callbacks


def build_trainer(
    run: TrainingRun,
    resolved: dict[str, Any],
    *,
    wandb_id: str | None = None,
    callbacks: Iterable[Callback] = (),
    loggers: list[Logger] | None = None,
) -> L.Trainer:
    """The Trainer of ``run`` (intervals in optimizer steps, converted to Lightning's micro-batch counts)."""
    t = run.trainer
    quiet_libraries()
    compat.warn_if_untested()
    if t.reuse_host_memory:
        reuse_freed_memory()
    strategy = build_strategy(run)
    progress, progress_bar = progress_callbacks(t.progress_bar, t.progress_seconds)
    k = t.accumulate_grad_batches
    assert is_precision(t.precision), t.precision  # validated (pretrain fit / finetune)
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=t.precision,
        max_steps=t.max_steps,
        max_epochs=-1,
        max_time=timedelta(minutes=t.max_time_minutes) if t.max_time_minutes else None,
        accumulate_grad_batches=k,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=micro_batches(t.val_check_interval, k),
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=min(t.log_every_n_steps, t.max_steps),  # a short run still logs its last step
        logger=build_loggers(run, resolved, wandb_id) if loggers is None else loggers,
        callbacks=[*build_callbacks(run), *progress, *callbacks],
        plugins=[checkpoint_io(run)] if strategy == "auto" else None,
        enable_progress_bar=progress_bar,
        use_distributed_sampler=False,  # the datamodule shards by rank itself (exact resume)
        default_root_dir=run.run_dir,
    )
    lightning_compat.log_at_steps_completed(trainer)  # the k-th optimizer step's metrics at step k
    if trainer.progress_bar_callback is not None:
        bar = trainer.progress_bar_callback
        # an instance's method replaced: mypy checks it against the unbound signature (self first)
        bar.get_metrics = metrics_of_logging_steps(bar.get_metrics)  # type: ignore[method-assign,assignment]
    if isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
        trainer.strategy.checkpoint_io.reclaimable = lambda: outside_retention(trainer)
    writer = getattr(trainer.strategy, "async_writer", None)
    if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
        trainer.strategy.checkpoint_io.strategy = trainer.strategy
        writer = trainer.strategy.checkpoint_io.writer
    callbacks_now = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, not declared
    guard = next((c for c in callbacks_now if isinstance(c, StepGuard)), None)
    if writer is not None and guard is not None:  # a checkpoint writes the guard's snapshot: one copy
        writer.host_copies = guard.host_copies
    return trainer


ProgressMetrics = dict[str, int | str | float | dict[str, float]]  # ProgressBar.get_metrics's


def metrics_of_logging_steps(
    get_metrics: Callable[[L.Trainer, L.LightningModule], ProgressMetrics],
) -> Callable[[L.Trainer, L.LightningModule], ProgressMetrics]:
    """A progress bar's ``get_metrics`` plus the training ``loss``, read again only on steps that log (and outside
    training): Lightning converts every progress-bar metric to a Python number on each refresh and on each read
    of ``callback_metrics``, a host read per batch -- so the module logs none with ``prog_bar`` and the bar
    takes ``train/loss`` (a host tensor) from the callback metrics here."""
    cache: dict[str, Any] = {}

    def cached(trainer: L.Trainer, pl_module: L.LightningModule) -> ProgressMetrics:
        if not cache or not trainer.training or lightning_compat.should_update_logs(trainer):
            cache.clear()
            cache.update(get_metrics(trainer, pl_module))
            loss = trainer.callback_metrics.get("train/loss")
            if loss is not None:
                with allowed():
                    cache["loss"] = round(float(loss), 4)
        return dict(cache)

    return cached


def outside_retention(trainer: L.Trainer) -> list[Path]:
    """Checkpoint files of the best-k callbacks that they no longer keep (e.g. the k-th best, already dropped
    from ``best_k_models`` while its replacement is being written); never a ``last`` checkpoint."""
    out = []
    for cb in trainer.checkpoint_callbacks:
        if not (
            isinstance(cb, ModelCheckpoint)
            and cb.monitor
            and cb.filename
            and cb.dirpath
            and Path(cb.dirpath).is_dir()
        ):
            continue
        kept = {Path(p).resolve() for p in cb.best_k_models} | {Path(cb.last_model_path).resolve()}
        pattern = cb.filename.split("{", 1)[0] + "*" + cb.FILE_EXTENSION
        out += [
            p for p in Path(cb.dirpath).glob(pattern) if p.resolve() not in kept and p.name != "last.ckpt"
        ]
    return out
