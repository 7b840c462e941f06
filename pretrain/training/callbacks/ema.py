"""Exponential moving average of the weights (config section ``ema``): after every ``every_n_steps``-th optimizer
step from ``start_step`` on, ``ema <- decay * ema + (1 - decay) * theta`` (the first such step copies theta).

Each rank averages the part of every parameter it holds -- the whole parameter under one device, DDP and
ZeRO-1/2 (whose weights are whole on every rank after the step), its shard under FSDP2 (the ``DTensor``'s local
tensor) and ZeRO-3 (its partition) -- in float32, with no communication: the average of a shard is the shard of
the average, so every layout holds one process's EMA.

The EMA is saved in every checkpoint as ``checkpoint["ema"]`` (parameter name -> tensor; FSDP2: ``DTensor``s,
sharded in DCP directories; ZeRO-3: each rank's partitions, ``ema_partitions``), restored with the checkpoint
(sliced to this layout's shards), validated after every validation as ``val/loss_ema`` (the validation batches
again, the EMA weights swapped in), and exported by ``pretrain export --ema``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from pretrain.checkpoint.io import EMA_KEY
from pretrain.compat import lightning as lightning_compat
from pretrain.training.module import PretrainModule


class EMA(Callback):
    """The weights' exponential moving average (see the module docstring)."""

    def __init__(self, decay: float, every_n_steps: int = 1, start_step: int = 0):
        self.decay, self.every_n_steps, self.start_step = decay, every_n_steps, start_step
        self.averages: dict[str, Tensor] = {}  # this rank's part of each parameter's average, float32
        self.updates = 0
        self._loaded: dict[str, Tensor] | None = None
        self._step = -1

    @property
    def state_key(self) -> str:
        return "EMA"

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])

    # ------------------------------------------------------------------------------------------ update
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        if self._loaded is not None:
            parts = lightning_compat.local_parts(trainer.strategy, pl_module)
            self.averages = {
                name: lightning_compat.local_part_of(trainer.strategy, param, self._loaded[name])
                .float()
                .clone()
                for name, param in parts.items()
            }
            self._loaded = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._step:  # a micro-batch within an accumulated step
            return
        self._step = step
        if step < self.start_step or (step - self.start_step) % self.every_n_steps:
            return
        parts = lightning_compat.local_parts(trainer.strategy, pl_module)
        with torch.no_grad():
            if not self.averages:
                self.averages = {name: part.detach().float().clone() for name, part in parts.items()}
            else:
                for name, part in parts.items():
                    self.averages[name].mul_(self.decay).add_(part.detach().float(), alpha=1.0 - self.decay)
        self.updates += 1

    # ------------------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.averages:
            key, averages = lightning_compat.savable_parts(trainer.strategy, pl_module, self.averages)
            checkpoint[key] = averages

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._loaded = checkpoint.get(EMA_KEY) or checkpoint.get(lightning_compat.EMA_PARTITIONS) or None

    # ------------------------------------------------------------------------------------------ validation
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The validation batches again with the EMA weights: ``val/<metric>_ema``."""
        if not self.averages or trainer.sanity_checking or not hasattr(pl_module, "_val_sums"):
            return
        assert isinstance(pl_module, PretrainModule)  # ema is a pretraining run's section
        parts = lightning_compat.local_parts(trainer.strategy, pl_module)
        saved = {name: part.detach().clone() for name, part in parts.items()}
        sums = pl_module._val_sums
        try:
            with torch.no_grad():
                for name, part in parts.items():
                    part.copy_(self.averages[name].to(part.dtype))
            pl_module._val_sums = {}
            data = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
            for i, batch in enumerate(data.val_dataloader()):
                batch = data.on_before_batch_transfer(batch, 0)
                batch = trainer.strategy.batch_to_device(batch)
                with torch.no_grad():
                    pl_module.validation_step(batch, i)
            keys = sorted(pl_module._val_sums)
            totals = dict(zip(keys, pl_module._reduce(torch.stack([pl_module._val_sums[k] for k in keys]))))
            metrics = {f"val/{k}_ema": v for k, v in pl_module.objective.summarize(totals).items()}
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False)
        finally:
            with torch.no_grad():
                for name, part in parts.items():
                    part.copy_(saved[name])
            pl_module._val_sums = sums
