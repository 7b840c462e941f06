"""Train or validate a recipe: what ``pretrain fit`` and ``pretrain validate`` run once the config is loaded.

The config is loaded and validated (``pretrain.config.load``) before these functions import torch or Lightning,
so bad input is reported at once.
"""

from __future__ import annotations

import gc
import shlex
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig
from pretrain.errors import InputError


def fit(run: RunConfig, resolved: dict[str, Any], recipe: str, overrides: list[str]) -> int:
    """Train ``run`` (``resolved``: its config as a dict) under the run directory's lock; ``recipe`` and
    ``overrides``: what it was loaded from, for the command that continues an interrupted run. Exit status."""
    check_input_files(run)
    # with the GC schedule, no automatic collection during set-up either: importing torch and Lightning and
    # building the run makes ~350k long-lived objects, which Python's GC would scan in full ~6 times (~0.4 CPU-s)
    from pretrain.io import run_lock

    without_gc = bool(run.trainer.gc_every_n_steps) and gc.isenabled()
    if without_gc:
        gc.disable()
    try:
        with run_lock(run.run_path, "`pretrain fit`"):  # one writer of the run's checkpoints and logs
            return _fit(run, resolved, recipe, overrides)
    finally:
        if without_gc:
            gc.enable()


def check_input_files(run: RunConfig) -> None:
    """``run_dir`` is no file; the tokenizer, every source's prepared corpus (each missing one named with the verb
    that makes it) and a ``resume`` checkpoint exist: checked before Lightning is imported."""
    from pretrain.config.run import check_resume_path
    from pretrain.datamodules.prepare import read_meta
    from pretrain.datamodules.tokenizer import load_tokenizer

    if run.run_path.exists() and not run.run_path.is_dir():
        raise InputError(f"run_dir={run.run_dir} is a file; give a directory (it is created if missing)")
    load_tokenizer(run.tokenizer.path)
    for source in run.data.sources:
        read_meta(source.prepared)
    check_resume_path(run)


def _fit(run: RunConfig, resolved: dict[str, Any], recipe: str, overrides: list[str]) -> int:
    from pretrain.checkpoint.reshard import CACHE, loadable, remove_cache
    from pretrain.compat import (
        lightning as lightning_compat,  # before Lightning: without torchmetrics' extras
    )
    from pretrain.errors import RankDied, peer_gone
    from pretrain.training.callbacks.preemption import Interrupted
    from pretrain.training.quiet import data_position_restored
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    parts = prepare_run(run, resolved)
    restore = parts.ckpt
    if restore is not None:
        if finished(run, restore):
            return 0
        stage = run.strategy.deepspeed.stage if run.strategy.name == "deepspeed" else None
        world = run.trainer.devices * run.trainer.num_nodes
        restore = loadable(restore, run.strategy.name, world, stage, run.run_path / CACHE)
    module = parts.module
    trainer = build_trainer(run, resolved, wandb_id=module.wandb_id)
    try:
        with data_position_restored():  # datamodules/pretrain.py
            trainer.fit(module, datamodule=parts.datamodule, ckpt_path=restore, weights_only=True)
    except Interrupted as stop:
        if trainer.is_global_zero:
            again = [recipe, *(o for o in overrides if not o.startswith("resume=")), "resume=auto"]
            command = " ".join(["pretrain fit", *map(shlex.quote, again)])
            print(f"\n== pretrain fit: {stop} ==\n  continue with: {command}")
        return stop.exit_status
    except Exception as err:
        if not peer_gone(err):  # a collective failed: name the rank that died
            raise
        raise RankDied(lightning_compat.dead_ranks(trainer), trainer.global_rank, err) from err
    finally:
        if trainer.is_global_zero:
            remove_cache(run.run_path)  # converted checkpoints: every rank loaded its state at the start
    last = run.checkpoint_dir / "last.ckpt"  # written after the last step by LastCheckpoint
    if trainer.is_global_zero:
        summary(trainer, run, module, last if last.exists() else parts.ckpt)
        drawn = run.logger.csv and run.logger.curves
        if drawn and any((run.run_path / "logs").glob("version_*/metrics.csv")):
            from pretrain.training.callbacks.plots import plot_runs

            print(f"  curves: {plot_runs([run.run_path], run.run_path / 'curves.png')}")
    return 0


def optimizer_groups(run: RunConfig) -> str:
    """The optimizer's parameter groups for ``run`` (shapes only: the model is built on the meta device)."""
    import torch

    from pretrain.models.transformer import Transformer
    from pretrain.optim import build_optimizer, describe

    with torch.device("meta"):
        model = Transformer(run.model)
    return describe(build_optimizer(model, run.optim, width_mult=run.model.width_mult))


def finished(run: RunConfig, ckpt: Path) -> bool:
    """A run already at ``trainer.max_steps``: say so (and how to train more) instead of training 0 steps."""
    from pretrain.checkpoint.resume import checkpoint_step

    step = checkpoint_step(ckpt)
    if step < run.trainer.max_steps:
        return False
    keep = ""
    if run.optim.decay_steps is None and run.optim.schedule in ("cosine", "linear", "wsd"):
        keep = f" with optim.decay_steps={run.trainer.max_steps} (the schedule it decayed over)"
    print(
        f"\n== pretrain fit: nothing to train ==\n  steps: {step} (run {run.name!r} already reached "
        f"trainer.max_steps={run.trainer.max_steps}; checkpoint: {ckpt})\n  to train it further raise "
        f"trainer.max_steps{keep}; for a new run set name=NEW (or resume=null to overwrite this one)"
    )
    return True


def summary(trainer: Any, run: RunConfig, module: Any, last: Path | None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    lines = [f"steps: {trainer.global_step} (tokens seen {module.tokens_seen:,})", f"checkpoint: {last}"]
    best = [
        cb.best_model_path
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.monitor and cb.best_model_path
    ]
    if best:
        lines.append(f"best checkpoint: {best[0]}")
    for name, value in sorted(trainer.callback_metrics.items()):
        if name.startswith("val/"):
            lines.append(f"{name}: {float(value):.4f}")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            experiment = logger.experiment
            run_dir = Path(experiment.dir).parent
            lines.append(
                f"W&B run: {experiment.id} ({'offline' if experiment.offline else 'online'}) {run_dir}"
            )
            if experiment.offline:
                lines.append(f"  upload with: wandb sync {run_dir}")
            wandb.finish()
        elif isinstance(logger, CSVLogger):
            csv_file = Path(logger.log_dir) / "metrics.csv"
            if csv_file.is_file():
                lines.append(f"metrics CSV: {csv_file}")
            else:
                lines.append(
                    f"metrics CSV: none (no step logged; trainer.log_every_n_steps={trainer.log_every_n_steps})"
                )
    print("\n== pretrain fit: done ==\n" + "\n".join(f"  {line}" for line in lines))


def validate(run: RunConfig, resolved: dict[str, Any]) -> int:
    """Validation metrics of ``run``'s checkpoint (``resume``: a given one, else the newest valid one), printed."""
    check_input_files(run)
    from pretrain.checkpoint.resume import strategy_reads
    from pretrain.compat import lightning as lightning_compat  # noqa: F401  (before Lightning: without torchmetrics' extras)
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    parts = prepare_run(run, resolved, training=False)
    if parts.ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {run.checkpoint_dir}; pass --ckpt PATH or train first")
    trainer = build_trainer(run, resolved, loggers=[])
    ckpt = parts.ckpt
    restore: Path | None = ckpt  # what the strategy restores (None: the weights are loaded already)
    # a directory of another strategy, or any checkpoint under DeepSpeed (whose engine cannot load ZeRO-3 weights
    # without an optimizer): the consolidated weights are loaded before the strategy sets the model up
    if run.strategy.name == "deepspeed" or not strategy_reads(run.strategy.name, ckpt):
        from pretrain.checkpoint.convert import load_model

        parts.module.model.load_state_dict(load_model(ckpt)[0].state_dict())
        restore = None
    results = trainer.validate(
        parts.module, datamodule=parts.datamodule, ckpt_path=restore, weights_only=True, verbose=False
    )
    if trainer.is_global_zero:
        print(f"checkpoint: {parts.ckpt}")
        for name, value in sorted(results[0].items()):
            print(f"  {name}: {value:.4f}")
    return 0
