"""Every use of Lightning's and DeepSpeed's private internals, in one place.

Tested with lightning 2.6.6, deepspeed 0.19.8 and torch 2.13 (CPU/gloo); revisit on upgrades of either. Each
item names the public behaviour it stands in for:

- ``should_update_logs``: Lightning's schedule of logged steps (``log_every_n_steps``) as the logger sees it.
- ``log_metrics``: metrics logged at the trainer's step (and put into ``callback_metrics``), as
  ``LightningModule.log`` does on a logging step, without its per-value bookkeeping.
- ``engine_divides_by_accumulation``: DeepSpeed's engine divides the loss by its accumulation steps on top of
  Lightning's own division.
- ``DeepSpeedAnyDevice``: Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators and checks CUDA device
  indices; DeepSpeed itself runs ZeRO-1/2/3 on the CPU (gloo). Directory checkpoints are written atomically
  and carry ``meta.pt`` (the Lightning state without weights).
- ``validation_follows``: whether Lightning validates right after this training batch (its epoch loop's
  ``_should_check_val_fx``), so ``last.ckpt`` is written after that validation, best-k state included.
- ``dead_ranks``: which of the processes Lightning's subprocess launcher started (``launcher.procs``) have died.
- ``StepProgressBar``: Lightning's rich progress bar describes training as "Epoch 1/-2" when ``max_epochs=-1``
  (training bounded by steps); it reads "Epoch 1" there.
- ``PerModuleSharding``: Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor) insists that the LightningModule
  parallelizes itself in ``configure_model``; here a ``parallelize`` function passed to the strategy shards the
  model from outside, on a 1-D data-parallel mesh (or 2-D for hybrid sharding). Checkpoints are written
  atomically.
- ``import_torchmetrics_lean``: Lightning imports torchmetrics at start (``lightning_utilities.compare_version``
  and ``from torchmetrics import Metric``), whose ``__init__`` imports every integration it finds installed:
  transformers (BERTScore, CLIPScore), ``scipy.signal`` (audio) and matplotlib (``Metric.plot``) -- 1.2 CPU-s,
  a fifth of a short run's start-up. This module is imported before Lightning and imports torchmetrics with those
  three hidden (absent from ``sys.modules``, torchmetrics' availability flags false), so the metrics Lightning and
  finetuning use stay and those integrations of torchmetrics are off in the process (import torchmetrics before
  ``pretrain`` to keep them). Tested with torchmetrics 1.9.0 and lightning-utilities 0.15.3.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

TORCHMETRICS_EXTRAS = ("transformers", "scipy", "matplotlib")  # torchmetrics imports these when installed


class _AfterExec(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` has executed, before anything imports from it."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path) if fullname == self.name else None
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_then(module: Any) -> None:
                run(module)
                self.then(module)

            spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def import_torchmetrics_lean(hidden: tuple[str, ...] = TORCHMETRICS_EXTRAS) -> None:
    """Import torchmetrics with the packages ``hidden`` that are not imported yet seen as absent: ``None`` in
    ``sys.modules`` for the import (Python's documented way to block one) and false flags in
    ``torchmetrics.utilities.imports`` (``RequirementCache``, which reads package metadata). No-op once
    torchmetrics is imported."""
    if "torchmetrics" in sys.modules:
        return
    blocked = [name for name in hidden if name not in sys.modules]

    def hide_flags(flags: Any) -> None:
        for flag in vars(flags).values():
            requirement = getattr(flag, "requirement", None)
            if isinstance(requirement, str) and re.split(r"[<>=!~ \[]", requirement)[0] in blocked:
                flag.available, flag.message = False, f"{requirement} hidden by pretrain (lightning_compat)"

    hook = _AfterExec("torchmetrics.utilities.imports", hide_flags)
    sys.meta_path.insert(0, hook)
    sys.modules.update(dict.fromkeys(blocked))
    try:
        import torchmetrics

        lean = True
    except ImportError:  # a torchmetrics release that needs one of them: imported as it is below
        lean = False
    finally:
        sys.meta_path.remove(hook)
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
        from lightning_utilities.core.imports import package_available

        package_available.cache_clear()  # it cached "absent" for the hidden ones
    if not lean:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchmetrics"]:
            del sys.modules[name]
        import torchmetrics  # noqa: F401


import_torchmetrics_lean()  # before Lightning's first import (every training path imports this module first)

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from pretrain.training.checkpoint.io import atomic_directory

TESTED_WITH = {
    "lightning": "2.6.6",
    "deepspeed": "0.19.8",
    "torch": "2.13.0",
    "torchmetrics": "1.9.0",
    "lightning-utilities": "0.15.3",
}


def untested_versions() -> dict[str, str]:
    """``{package: installed version}`` of the installed ``TESTED_WITH`` packages at another release (a local
    build tag such as ``+cpu`` aside)."""
    found = {}
    for name, tested in TESTED_WITH.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if installed.split("+")[0] != tested:
            found[name] = installed
    return found


def warn_if_untested() -> None:
    """One warning naming the packages whose private internals used here may have changed."""
    if found := untested_versions():
        listed = ", ".join(f"{n} {v} (tested: {TESTED_WITH[n]})" for n, v in sorted(found.items()))
        warnings.warn(
            f"pretrain.training.lightning_compat uses private internals tested with other releases: {listed}; "
            "check the items of its docstring if training misbehaves",
            stacklevel=2,
        )


def should_update_logs(trainer: Any) -> bool:
    """Whether this step is one Lightning logs (``log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def log_metrics(trainer: Any, metrics: dict[str, Any], callback: bool = False) -> None:
    """Send ``metrics`` to every logger at the step of the metrics ``LightningModule.log`` gives it now; with
    ``callback``, also into ``trainer.callback_metrics`` (what checkpoint monitors, early stopping and the
    progress bar read), as ``LightningModule.log(on_step=True, on_epoch=False)`` would put them -- without its
    per-value bookkeeping (a result metric moved to the value's device and updated: ~0.4 ms a value)."""
    trainer._logger_connector.log_metrics(metrics)
    if callback:
        trainer._logger_connector._callback_metrics.update(metrics)


def validation_follows(trainer: Any) -> bool:
    """Whether the validation loop runs right after the training batch that just ended."""
    loop = trainer.fit_loop.epoch_loop
    return (
        bool(trainer.enable_validation)
        and not loop._skip_next_val
        and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    )


def dead_ranks(trainer: Any, wait_s: float = 2.0) -> list[int]:
    """Global ranks of the processes this node's launcher started that have exited with an error (rank 0 of a node
    knows its local peers; a peer's own failure is in its output). A killed peer's sockets close a moment before
    its exit status can be read, so this waits up to ``wait_s`` for one to appear."""
    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or []
    first = trainer.node_rank * trainer.num_devices
    deadline = time.monotonic() + wait_s
    while not (dead := [first + i + 1 for i, p in enumerate(procs) if p.poll() not in (None, 0)]) and procs:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return dead


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar without the "/-2" of an unbounded epoch count."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        return (
            description.replace(f"/{self.trainer.max_epochs - 1}", "")
            if self.trainer.max_epochs == -1
            else description
        )


def engine_divides_by_accumulation(strategy: Strategy) -> bool:
    """DeepSpeed's ``engine.backward`` scales the loss by 1/k once more after Lightning's 1/k."""
    return isinstance(strategy, DeepSpeedStrategy)


class DeepSpeedAnyDevice(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that also runs on the CPU (gloo), with atomic checkpoint directories."""

    def _on_cpu(self) -> bool:
        return self.parallel_devices is not None and self.parallel_devices[0].type == "cpu"

    @property
    def root_device(self) -> torch.device:
        """On the CPU, ``cpu:<local rank>``: DeepSpeed takes the device index as the rank's device number."""
        return torch.device("cpu", self.local_rank) if self._on_cpu() else super().root_device

    def setup_environment(self) -> None:
        if self._on_cpu():
            DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only check
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with atomic_directory(filepath, self) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            if self.is_global_zero:
                torch.save(meta, tmp / _METADATA_FILENAME)


class PerModuleSharding(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose model is sharded by ``parallelize(model, mesh)`` (FSDP2 ``fully_shard``)
    instead of ``LightningModule.configure_model``. The mesh is 1-D (all ranks) unless ``hybrid``: then
    (nodes, devices per node), replicated across nodes and sharded within one."""

    def __init__(
        self, parallelize: Callable[[nn.Module, Any], None], *, hybrid: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.parallelize, self.hybrid = parallelize, hybrid

    def setup_environment(self) -> None:
        if self.hybrid:
            self._data_parallel_size, self._tensor_parallel_size = self.num_nodes, self.num_processes
        else:
            self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()

    def mesh(self) -> Any:
        return self.device_mesh if self.hybrid else self.device_mesh["data_parallel"]

    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` with ``parallelize`` in place of the ``configure_model`` requirement."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.parallelize(self.model, self.mesh())
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        with atomic_directory(filepath, self) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory, or a single file (DDP's or a consolidated one: optimizer state keyed by position
        in the parameter groups, mapped to parameter names here)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from pretrain.training.checkpoint.convert import optimizer_state_by_name
        from pretrain.training.checkpoint.io import read

        checkpoint = read(path)
        full = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=full)
        states = checkpoint.pop("optimizer_states", [])
        for optimizer, state in zip(self.optimizers, states if self.optimizers else []):
            by_name = optimizer_state_by_name(state, optimizer, self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=by_name, options=full)
        return checkpoint
