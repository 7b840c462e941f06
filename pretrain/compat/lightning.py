"""Every use of Lightning's and DeepSpeed's private internals, in one place.

Tested with lightning 2.6.6, deepspeed 0.19.8 and torch 2.13 (CPU/gloo); revisit on upgrades of either. Each
item names the public behaviour it stands in for:

- ``should_update_logs``: Lightning's schedule of logged steps (``log_every_n_steps``) as the logger sees it.
- ``log_metrics``: metrics logged at the trainer's step (and put into ``callback_metrics``), as
  ``LightningModule.log`` does on a logging step, without its per-value bookkeeping.
- ``log_at_steps_completed``: Lightning logs the metrics of a training step, and of a validation after it, at the
  number of optimizer steps completed before that step (its epoch loop's ``_batches_that_stepped``: 0 for the
  first); here they are logged at the step's number counted from 1 -- ``trainer.global_step`` once it has stepped,
  the number in the checkpoint names and the progress lines.
- ``engine_divides_by_accumulation``: DeepSpeed's engine divides the loss by its accumulation steps on top of
  Lightning's own division.
- ``without_shared_memory_allreduce``: DeepSpeed's table of compatible ops (``deepspeed.ops.__compatible_ops__``)
  marks its CPU shared-memory all-reduce unavailable, so a CPU launch does not compile it (training never calls it).
- ``DeepSpeedAnyDevice``: Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators and checks CUDA device
  indices; DeepSpeed itself runs ZeRO-1/2/3 on the CPU (gloo). Directory checkpoints are written atomically
  and carry ``meta.pt`` (the Lightning state without weights).
- ``validation_follows``: whether Lightning validates right after this training batch (its epoch loop's
  ``_should_check_val_fx``), so ``last.ckpt`` is written after that validation, best-k state included.
- ``dead_ranks``: which of the processes Lightning's subprocess launcher started (``launcher.procs``) have died.
- ``StepProgressBar``: Lightning's rich progress bar describes training as "Epoch 1/-2" when ``max_epochs=-1``
  (training bounded by steps); it reads "Epoch 1" there.
- ``PerModuleSharding``: Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor) insists that the LightningModule
  parallelizes itself in ``configure_model`` and builds its own 2-D mesh; here the run's named mesh
  (``pretrain.parallel.mesh``: its ``_device_mesh``, made in ``setup_environment`` after its private
  ``_setup_distributed``) is handed to a ``parallelize`` function that parallelises the model from outside
  (tensor parallelism, then FSDP2). Data-parallel sampling follows the mesh; checkpoints are written atomically.
- ``fresh_optimizer`` (``resume_allow=[optimizer]``): a restore without the checkpoint's optimizer state. Lightning
  loads it in ``Strategy.load_optimizer_state_dict`` (DDP, one device: the module's ``on_load_checkpoint`` empties
  ``optimizer_states``), in ``ModelParallelStrategy.load_checkpoint`` for every optimizer the strategy holds (a
  sharded directory: loaded with the optimizers set aside) and through DeepSpeed's
  ``engine.load_checkpoint(load_optimizer_states=...)``.
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
from collections.abc import Callable
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
    sys.modules.update(dict.fromkeys(blocked))  # type: ignore[arg-type]  # None blocks an import (Python's way)
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

from pretrain.checkpoint.io import EMA_KEY, atomic_directory
from pretrain.parallel.mesh import ParallelDims, RunMesh


def without_anonymous(logger: Any) -> None:
    """Drop the ``anonymous`` argument Lightning's ``WandbLogger`` passes ``wandb.init`` (None unless asked for):
    wandb (0.31.0 here) prints "The anonymous setting has no effect" for it on every run, whatever its value."""
    logger._wandb_init.pop("anonymous", None)


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


def log_at_steps_completed(trainer: Any) -> None:
    """While fitting, every metric Lightning logs without a step of its own (``LightningModule.log``, a validation,
    ``log_metrics`` above) is logged at the number of the optimizer step it belongs to, counted from 1: the
    trainer's ``global_step`` after that step (Lightning: one less, the steps completed before it). Lightning's
    ``epoch`` column stays."""
    connector = trainer._logger_connector
    log = connector.log_metrics

    def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
        if metrics and step is None and "step" not in metrics and trainer.state.fn == "fit":
            step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
            metrics = {**metrics, "epoch": metrics.get("epoch", trainer.current_epoch)}
        log(metrics, step)

    connector.log_metrics = log_metrics


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


def fresh_optimizer(module: Any) -> bool:
    """Whether ``module`` (a LightningModule) resumes with a new optimizer state (``resume_allow=[optimizer]``)."""
    return "optimizer" in getattr(module, "resume_changes", ())


EMA_PARTITIONS = "ema_partitions"  # ZeRO-3: {"parts": name -> this rank's partition, "shapes": name -> shape}


def ema_partition_file(rank: int) -> str:
    return f"ema_partitions.rank{rank}.pt"


def local_parts(strategy: Strategy, module: nn.Module) -> dict[str, torch.Tensor]:
    """The part of each trainable parameter this rank holds, writable in place: the whole parameter (one device,
    DDP, ZeRO-1/2), a DTensor's local shard (FSDP2), a ZeRO-3 parameter's partition (its ``ds_tensor``)."""
    out = {}
    params: dict[str, Any] = dict(module.named_parameters())  # DeepSpeed's / DTensor's attributes read below
    for name, param in params.items():
        if not param.requires_grad:
            continue
        if hasattr(param, "ds_tensor"):
            out[name] = param.ds_tensor.data
        elif hasattr(param, "to_local"):
            out[name] = param.data.to_local()
        else:
            out[name] = param.data
    return out


def local_part_of(strategy: Any, param: Any, value: Any) -> torch.Tensor:
    """This rank's part (as :func:`local_parts` holds it) of ``value``: a whole tensor, a DTensor, or already the
    part (a ZeRO-3 partition restored by the same layout); no communication."""
    if hasattr(value, "to_local"):
        return value.to_local()
    if hasattr(param, "ds_tensor"):
        size = param.ds_tensor.numel()
        if value.numel() == size and value.numel() != param.ds_numel:
            return value
        flat = value.reshape(-1)
        start = min(strategy.global_rank * size, flat.numel())
        part = flat[start : start + size]
        return torch.cat([part, part.new_zeros(size - part.numel())]) if part.numel() < size else part
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return value


def savable_parts(
    strategy: Strategy, module: nn.Module, parts: dict[str, torch.Tensor]
) -> tuple[str, dict[str, Any]]:
    """``(checkpoint key, value)`` of this rank's ``parts`` of per-parameter tensors for this strategy's
    checkpoint: DTensors for FSDP2's sharded checkpoints (whole tensors, gathered, for its ``full`` one), ZeRO-3
    partitions with the parameters' shapes, whole tensors otherwise."""
    params: dict[str, Any] = dict(module.named_parameters())  # DeepSpeed's / DTensor's attributes read below
    if any(hasattr(p, "ds_tensor") for p in params.values()):
        shapes = {name: list(params[name].ds_shape) for name in parts}
        return EMA_PARTITIONS, {"parts": parts, "shapes": shapes}
    if any(hasattr(p, "device_mesh") for p in params.values()):
        from torch.distributed.tensor import DTensor

        sharded = {
            name: DTensor.from_local(
                part,
                params[name].device_mesh,
                params[name].placements,
                shape=params[name].shape,
                stride=params[name].stride(),
            )
            for name, part in parts.items()
        }
        if getattr(strategy, "_save_distributed_checkpoint", False):
            return EMA_KEY, sharded
        return EMA_KEY, {name: t.full_tensor() for name, t in sharded.items()}
    return EMA_KEY, parts


def zero_adam_state(zero_optimizer: Any, step: float) -> None:
    """Adam's state (moments at zero, ``step`` steps taken) on each fp32 partition of a ZeRO optimizer that has
    not stepped yet -- DeepSpeed creates it at the first step, and links each parameter's fragment of it then
    (ZeRO-1/2) -- so that ``deepspeed.utils.safe_set_full_optimizer_state`` can set the moments. The base
    optimizer is torch's AdamW (``torch.optim.Optimizer``'s state layout, ``step`` a float32 tensor) or
    DeepSpeed's CPU Adam under offload (``step`` an int)."""
    base = zero_optimizer.optimizer
    stage3 = hasattr(zero_optimizer, "fp32_partitioned_groups_flat")
    flats = (
        zero_optimizer.fp32_partitioned_groups_flat
        if stage3
        else zero_optimizer.single_partition_of_fp32_groups
    )
    counted = torch.tensor(step, dtype=torch.float32) if isinstance(base, torch.optim.AdamW) else int(step)
    for flat in flats:
        state = base.state[flat]
        state["step"] = counted.clone() if isinstance(counted, torch.Tensor) else counted
        for key in ("exp_avg", "exp_avg_sq"):
            state.setdefault(key, torch.zeros_like(flat))
    if not stage3:
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def engine_divides_by_accumulation(strategy: Strategy) -> bool:
    """DeepSpeed's ``engine.backward`` scales the loss by 1/k once more after Lightning's 1/k."""
    return isinstance(strategy, DeepSpeedStrategy)


def without_shared_memory_allreduce() -> None:
    """DeepSpeed's communication backend on the CPU builds its shared-memory all-reduce (``ShareMemCommBuilder``, a
    C++ op compiled on first use: ~45 s and a compiler) whenever the op is marked compatible
    (``deepspeed.ops.__compatible_ops__``, probed per launch); only ``inference_all_reduce`` (DeepSpeed
    inference's tensor-parallel layers) calls it, while ZeRO's collectives go through ``torch.distributed``
    (gloo) either way. Marking it incompatible is DeepSpeed's own fallback (its non-Linux path): no build, the
    same collectives."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


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
        without_shared_memory_allreduce()
        self._init_deepspeed_distributed()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DeepSpeed directory of this layout (DeepSpeed's own load), or a file or DCP directory of another
        strategy (``reshard``: a DeepSpeed directory of another layout arrives converted to DCP); without the
        optimizer state when the run re-initialises it (``fresh_optimizer``)."""
        from pretrain.checkpoint.io import kind

        path = Path(self.broadcast(str(checkpoint_path)))
        if kind(path) != "deepspeed":
            return self.load_foreign_checkpoint(path)
        partitions = path / ema_partition_file(self.global_rank)
        if partitions.is_file():  # this layout's (the same world size and stage: DeepSpeed's own load)
            return {
                **self.load_checkpoint_here(path, weights_only),
                EMA_PARTITIONS: torch.load(partitions, weights_only=True),
            }
        return self.load_checkpoint_here(path, weights_only)

    def load_checkpoint_here(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """A DeepSpeed checkpoint of this layout, by DeepSpeed's own load."""
        if not fresh_optimizer(self.lightning_module):
            return super().load_checkpoint(path, weights_only)
        engine = self.deepspeed_engine  # without the optimizer state when the run re-initialises it
        load = engine.load_checkpoint
        engine.load_checkpoint = lambda *args, **kwargs: load(
            *args, **{**kwargs, "load_optimizer_states": False}
        )
        try:
            return super().load_checkpoint(path, weights_only)
        finally:
            del engine.load_checkpoint  # the bound method again

    def load_foreign_checkpoint(self, path: Path) -> dict[str, Any]:
        """Set a file or DCP checkpoint into the ZeRO engine with DeepSpeed's API for partitioned state: each
        parameter's weights (ZeRO-3: gathered, set on rank 0, partitioned again), its fp32 master copy and Adam
        moments (``safe_set_full_*``: each rank keeps its partition); the step count and the groups'
        hyper-parameters on the engine's base optimizer. Returns the Lightning state."""
        from deepspeed import zero
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from pretrain.checkpoint.reshard import named_checkpoint

        module: Any = self.lightning_module  # the run's module (its optimizer_param_names, when it has them)
        group_names = module.optimizer_param_names() if hasattr(module, "optimizer_param_names") else []
        checkpoint = named_checkpoint(path, group_names)
        weights, optimizer = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_0", None)
        fitting = module.trainer.state.fn == TrainerFn.FITTING and optimizer is not None
        fitting = fitting and not fresh_optimizer(module)  # resume_allow=[optimizer]: moments start at zero
        steps = {float(s["step"]) for s in optimizer["state"].values() if "step" in s} if fitting else set()
        assert len(steps) <= 1, f"parameters at different optimizer steps: {sorted(steps)}"
        if fitting:
            zero_adam_state(self.deepspeed_engine.optimizer, steps.pop() if steps else 0.0)
        with torch.no_grad():
            for name, param in module.named_parameters():
                value = weights[name]
                if self.zero_stage_3:
                    with zero.GatheredParameters([param], modifier_rank=0):
                        if self.is_global_zero:
                            param.data.copy_(value)
                else:
                    param.data.copy_(value)
                safe_set_full_fp32_param(param, value)
                for key, moment in (optimizer["state"].get(name, {}) if fitting else {}).items():
                    if key != "step":
                        safe_set_full_optimizer_state(param, moment, key)
        if fitting:
            groups = self.deepspeed_engine.optimizer.param_groups
            for group, saved in zip(groups, optimizer["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        return checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        partitions = checkpoint.pop(EMA_PARTITIONS, None)  # ZeRO-3: each rank's part of the EMA, a file each
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with atomic_directory(filepath, self) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            if partitions is not None:
                torch.save(partitions, tmp / ema_partition_file(self.global_rank))
            if self.is_global_zero:
                torch.save(meta, tmp / _METADATA_FILENAME)


class PerModuleSharding(ModelParallelStrategy):
    """``ModelParallelStrategy`` on the mesh of ``dims`` (``pretrain.parallel.mesh``), whose model is parallelised
    by ``parallelize(model, mesh)`` instead of ``LightningModule.configure_model``; a data-parallel rank is a
    context-parallel x tensor-parallel group (its ranks read the same batch)."""

    def __init__(
        self, parallelize: Callable[[nn.Module, RunMesh], None], dims: ParallelDims, **kwargs: Any
    ) -> None:
        super().__init__(data_parallel_size=dims.dp, tensor_parallel_size=dims.tp, **kwargs)
        self.parallelize, self.dims = parallelize, dims
        self.run_mesh: RunMesh | None = None

    def _connected_module(self) -> Any:
        """The LightningModule, once the Trainer has connected it."""
        assert self.lightning_module is not None, "connected by the Trainer before any checkpoint"
        return self.lightning_module

    def _set_up_model(self) -> nn.Module:
        """The (parallelised) model, once the strategy has set it up."""
        assert self.model is not None, "set up before any checkpoint"
        return self.model

    def setup_environment(self) -> None:
        """The process group (``ModelParallelStrategy``'s), then the run's mesh in place of Lightning's."""
        self._setup_distributed()
        if self.world_size != self.dims.world:
            raise ValueError(
                f"the mesh {self.dims} needs {self.dims.world} ranks, the job has {self.world_size}"
            )
        self.run_mesh = self.dims.build(self.root_device.type)
        self._device_mesh = self.run_mesh.root
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank(self.global_rank)}

    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` with ``parallelize`` in place of the ``configure_model`` requirement."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.run_mesh is not None
        self.parallelize(self.model, self.run_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    async_writer: Any = None  # an AsyncCheckpointWriter: sharded checkpoints written in the background

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint: the layout of ``ModelParallelStrategy.save_checkpoint`` (DCP shards of
        ``state_dict`` and ``optimizer_<i>``, ``meta.pt``), the EMA (``checkpoint["ema"]``) among the shards."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from pretrain.checkpoint.optimizer_state import dcp_state

        tensors = dcp_state(checkpoint, self.optimizers, self._connected_module())
        if self.async_writer is not None:
            self.async_writer.save(
                tensors,
                checkpoint,
                self.broadcast(str(filepath)),
                distributed=True,
                optimizers=self.optimizers,
            )
            return None
        import torch.distributed.checkpoint as torch_dcp

        with atomic_directory(filepath, self) as tmp:
            torch_dcp.save(tensors, checkpoint_id=tmp)
            if self.is_global_zero:
                torch.save(checkpoint, tmp / _METADATA_FILENAME)
        return None

    def teardown(self) -> None:
        if self.async_writer is not None:
            self.async_writer.close()  # a save still in flight is finished first
        super().teardown()

    def load_dcp_checkpoint(self, path: Path, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """A DCP directory, resharded to this mesh by ``torch.distributed.checkpoint`` (as
        ``ModelParallelStrategy.load_checkpoint`` loads it, but weights-only: ``checkpoint.dcp``), into the
        model and ``optimizers``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from pretrain.checkpoint import dcp
        from pretrain.checkpoint.io import METADATA, read

        model = self._set_up_model()
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        dcp.load(state, path, no_dist=False)
        strict = StateDictOptions(strict=self._connected_module().strict_loading)
        set_model_state_dict(model, state["state_dict"], options=strict)
        for i, optimizer in enumerate(optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, path, no_dist=False)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])
        checkpoint = read(path / METADATA)
        if any(k.startswith(f"{EMA_KEY}.") for k in dcp.metadata(path).state_dict_metadata):
            averages = {
                EMA_KEY: {n: torch.zeros_like(p) for n, p in self._connected_module().named_parameters()}
            }
            dcp.load(averages, path, no_dist=False)  # the EMA's shards of this mesh
            checkpoint[EMA_KEY] = averages[EMA_KEY]
        return checkpoint

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory (DDP's or a consolidated one: optimizer state keyed by position
        in the parameter groups, mapped to parameter names here)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        fresh = fresh_optimizer(self.lightning_module)
        if path.is_dir():
            return self.load_dcp_checkpoint(path, [] if fresh else self.optimizers)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from pretrain.checkpoint.io import read
        from pretrain.checkpoint.optimizer_state import optimizer_state_by_name

        checkpoint = read(path)
        model = self._set_up_model()
        full = StateDictOptions(full_state_dict=True, strict=self._connected_module().strict_loading)
        set_model_state_dict(model, checkpoint.pop("state_dict"), options=full)
        states = [] if fresh else checkpoint.pop("optimizer_states", [])
        for optimizer, state in zip(self.optimizers, states if self.optimizers else []):
            by_name = optimizer_state_by_name(state, optimizer, model)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name, options=full)
        return checkpoint
