"""``PretrainModule``: the backbone + an objective as a LightningModule, with a globally normalised loss.

The optimizer step's arithmetic (grouping k micro-batches, the all-reduced target count, the loss each
micro-batch backpropagates, dropout seeds) is ``pretrain.training.step``'s; this module runs the model on it.
Dropout draws from the global torch generator, re-seeded before every micro-batch from (seed, optimizer step,
micro-batch, data-parallel rank): a resumed run replays the same dropout masks with no RNG state to carry, and the
ranks of a tensor-parallel group draw alike where they hold the same activations (``pretrain.parallel.tensor``).
Under tensor parallelism the logits are vocabulary-sharded DTensors and the cross entropy is torch's
``loss_parallel``, forward and backward.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler

from pretrain.checkpoint.io import PAYLOAD
from pretrain.checkpoint.resume import apply_resume_changes, restart_schedules
from pretrain.compat import compile as compile_compat
from pretrain.compat import lightning as lightning_compat
from pretrain.config import RunConfig
from pretrain.datamodules.pretrain import PretrainDataModule
from pretrain.models.transformer import Transformer
from pretrain.objectives import IGNORE_INDEX, Objective
from pretrain.objectives.loss import num_correct
from pretrain.optim import build_optimizer, build_scheduler, describe, group_param_names
from pretrain.parallel.mesh import context_parallel_position, data_parallel_position
from pretrain.parallel.tensor import vocabulary_parallel
from pretrain.training.step import (
    STEP_TARGETS,
    FreeGradientsAfterStep,
    StepGroups,
    StepLossHooks,
    dropout_seed,
)
from pretrain.training.strategies import optimizer_offloaded

TARGET_POSITIONS = (
    "target_positions"  # (N,) flat indices of the labelled positions (sparse-target objectives)
)
# packed-document inputs that mask nothing when every row holds one document (padding aside: id -1, masked)
DOCUMENT_KEYS = ("document_ids", "position_ids", "decoder_document_ids", "decoder_position_ids")


class PretrainData(PretrainDataModule):
    """``PretrainDataModule`` whose training batches come in optimizer-step groups (see ``StepGroups``)."""

    objective: Objective  # a pretraining objective (its sparse_targets)

    def __init__(self, *args: Any, accumulate_grad_batches: int = 1, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.realign = False  # a resume with another global batch (resume_allow=[batch]): see load_state_dict

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """With ``realign`` (set by ``setup.check_same_batch``), a position that is not a whole number of this
        run's data-parallel batches moves back to the last one (the samples after it are read again)."""
        state = dict(state_dict)
        if self.realign:
            per_batch = self.micro_batch_size * self.world_size
            state["consumed_samples"] = int(state["consumed_samples"]) // per_batch * per_batch
        super().load_state_dict(state)

    @property
    def batches_per_epoch(self) -> int:
        """Whole optimizer steps only: ``StepGroups`` drops an epoch's trailing incomplete group."""
        k = self.accumulate_grad_batches
        return super().batches_per_epoch // k * k

    def train_dataloader(self) -> StepGroups:
        return StepGroups(super().train_dataloader(), self.accumulate_grad_batches)

    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        """Drop attention masks that mask nothing (packed samples have no padding), and document ids and positions
        when every row holds one document (they then mask nothing either: ids 0, positions 0, 1, ...), still on
        the CPU: the backbone then calls SDPA without an explicit mask (``is_causal`` for decoders), allowing
        FlashAttention. For an objective with ``sparse_targets`` add ``target_positions`` (N,), the flat indices of
        the labelled positions, so the LM head runs on those only; found here on the CPU, the device never waits
        for it. Under context parallelism the masks were dropped on the whole batch before it was cut
        (``SequenceShard``: every rank of a group must agree whether there is one) and document ids are kept (a
        rank's shard may hold one document while another's holds two)."""
        if self.sequence_shard is None and "document_ids" in batch and int(batch["document_ids"].max()) <= 0:
            for key in DOCUMENT_KEYS:
                batch.pop(key, None)
        for key in ("attention_mask", "decoder_attention_mask"):
            if key in batch and bool(batch[key].all()) and self.sequence_shard is None:
                del batch[key]
        if self.objective.sparse_targets and "labels" in batch:
            batch[TARGET_POSITIONS] = (batch["labels"].flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        return batch

    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        """``target_positions`` (N,) has a symbolic length for ``torch.compile``: N varies every batch (MLM, prefix
        LM, UL2), and one dynamic graph serves them all instead of a recompile (padding N to buckets was slower
        on the CPU: ``benchmarks/bench_compile_targets.py``)."""
        if TARGET_POSITIONS in batch:
            compile_compat.mark_dynamic(batch[TARGET_POSITIONS], 0)
        return super().on_after_batch_transfer(batch, dataloader_idx)  # counts the batch (exact resume)


def _seed_generators(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from: the CPU's and ``device``'s (``torch.manual_seed`` also seeds every
    other backend; on one without a device it formats the call stack to queue the seed: a millisecond a step)."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        torch.get_device_module(device).manual_seed(seed)


class PretrainModule(StepLossHooks, FreeGradientsAfterStep, L.LightningModule):
    """Backbone (``pretrain.models.transformer.Transformer``) trained with ``objective``; logs loss, accuracy, perplexity
    (LM objectives), tokens seen, learning rate and gradient norm; MFU comes from ``flops_per_batch``."""

    def __init__(
        self,
        run: RunConfig,
        objective: Objective,
        *,
        resolved: dict[str, Any],
        tokenizer_json: str | None = None,
        wandb_id: str | None = None,
        data_keys: dict[str, Any] | None = None,
    ):
        super().__init__()  # objective and architecture are checked together by setup.build_objective
        self.run, self.objective, self.resolved = run, objective, resolved
        self.tokenizer_json, self.wandb_id = tokenizer_json, wandb_id
        self.data_keys = data_keys  # each source's corpus key: a resume checks it trains on the same data
        self.model = Transformer(run.model)
        self.model.check_inputs = False  # the tokenizer/vocab fit is checked once before training
        self.model.gradient_checkpointing = run.trainer.activation_checkpointing
        self.tensor_parallel = run.strategy.tensor_parallel > 1  # vocabulary-sharded logits
        if run.trainer.float8:
            from pretrain.training.float8 import convert_to_float8

            convert_to_float8(self.model, fsdp=run.strategy.name == "fsdp")
        if run.trainer.compile:
            self.model.compile()  # compiles __call__ in place: parameter names and state_dict unchanged
        self.tokens_seen = 0
        self.flops_per_batch = 0.0  # read by the ThroughputMonitor after every batch
        with torch.device(
            "meta"
        ):  # shapes only: FLOPs of the whole model, whatever shards the strategy makes
            self._flops_per_token = Transformer(run.model).flops_per_token
        self.resume_changes: frozenset[str] = (
            frozenset()
        )  # resume_allow entries that differ (setup.prepare_run)
        self.base_lrs: list[float] = []  # each parameter group's base learning rate (configure_optimizers)
        self.decayed_tensors = 0  # weight-decayed parameter tensors (set by configure_optimizers)
        self._flops_per_sample: dict[tuple[int, int | None], tuple[float, float]] = {}
        self._num_correct: Tensor | None = None
        self._val_sums: dict[str, Tensor] = {}

    # ------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _split(batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        """Model inputs, and the labels the logits predict: (B, T), or (N,) with ``target_positions``."""
        inputs = {k: v for k, v in batch.items() if k not in ("labels", STEP_TARGETS)}
        labels = batch["labels"]
        if TARGET_POSITIONS in batch:
            labels = labels.flatten()[batch[TARGET_POSITIONS]]
        return inputs, labels

    def _batch_flops(self, inputs: dict[str, Tensor], backward: bool) -> float:
        """Model FLOPs of one micro-batch (forward + backward, or forward only), the LM head counted at its
        ``target_positions`` only; cached per shape. Under context parallelism those of the whole sequences
        (this rank's positions times the context-parallel size; the LM head at as many targets on every rank),
        which the throughput monitor shares among a data-parallel rank's devices."""
        cp = self.run.strategy.context_parallel
        batch, seq = inputs["input_ids"].shape
        seq *= cp
        dec = inputs["decoder_input_ids"].shape[1] * cp if "decoder_input_ids" in inputs else None
        if (seq, dec) not in self._flops_per_sample:  # (all positions, without the head)
            self._flops_per_sample[seq, dec] = (
                self._flops_per_token(seq, dec, head_positions=None) * seq,
                self._flops_per_token(seq, dec, head_positions=0) * seq,
            )
        full, headless = self._flops_per_sample[seq, dec]
        flops = full * batch
        if TARGET_POSITIONS in inputs:
            head_per_position = (full - headless) / (dec or seq)
            flops = headless * batch + head_per_position * len(inputs[TARGET_POSITIONS]) * cp
        return flops if backward else flops / 3

    def _reduce(self, t: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(t, reduce_op="sum") if self.trainer.world_size > 1 else t

    # ------------------------------------------------------------------------------------------ training
    def on_train_start(self) -> None:
        self.start_step_loss()
        restart_schedules(self, self.base_lrs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Micro-batch ``batch_idx`` of the running optimizer step; see ``pretrain.training.step``."""
        step, k = self.step_loss, self.trainer.accumulate_grad_batches
        assert step is not None
        micro = batch_idx % k
        dp_rank, dp_size = data_parallel_position(self.trainer)
        cp_rank, cp_size = context_parallel_position(self.trainer)
        if self.run.model.dropout or self.run.model.attn_dropout:  # nothing else in a step draws from them
            # one stream per (data-parallel, context-parallel) rank: per batch and slice of its sequences
            rank = dp_rank * cp_size + cp_rank
            _seed_generators(dropout_seed(self.run.seed, self.global_step, micro, rank), self.device)
        if micro == 0:
            step.begin(batch[STEP_TARGETS])
            self._num_correct = None
        inputs, labels = self._split(batch)
        with vocabulary_parallel(self.tensor_parallel):
            logits = self.model(**inputs).logits
            loss_sum, _ = self.objective.loss(logits, labels)
        self.flops_per_batch = self._batch_flops(inputs, backward=True)
        self.tokens_seen += inputs["input_ids"].numel() * dp_size * cp_size
        loss = step.add(loss_sum)

        if lightning_compat.should_update_logs(self.trainer):
            correct = num_correct(logits.detach(), labels)
            self._num_correct = correct if self._num_correct is None else self._num_correct + correct
        return loss

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward, under ``loss_parallel`` with tensor parallelism (its cross entropy's backward)."""
        with vocabulary_parallel(self.tensor_parallel):
            super().backward(loss, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """On a logging step, the step's loss, accuracy (perplexity) and global gradient norm (before clipping;
        sharded (DTensor) gradients reduced over ranks), brought to the host in one transfer."""
        if not lightning_compat.should_update_logs(self.trainer):
            return
        step = self.step_loss
        assert step is not None and step.loss_sum is not None and self._num_correct is not None
        totals = [*self._reduce(torch.stack([step.loss_sum, self._num_correct.float()])), step.num_targets]
        norm = step.grad_norm(_optimized(optimizer))  # None under DeepSpeed (its engine's gradients)
        if norm is not None:
            totals.append(
                norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            )  # DTensor: made global
        host = torch.stack([t.float() for t in totals]).cpu()  # the step's one device-to-host transfer
        summary = dict(zip(("loss_sum", "num_correct", "num_targets"), host))
        metrics = {f"train/{k}": v for k, v in self.objective.summarize(summary).items()}
        if norm is not None:
            metrics["train/grad_norm"] = float(host[3])
        metrics["train/tokens_seen"] = float(self.tokens_seen)
        data = self.trainer.datamodule
        if isinstance(data, PretrainDataModule) and len(data.names) > 1:  # corpus tokens read, per source
            metrics.update(
                {f"train/corpus_tokens/{n}": float(t) for n, t in data.tokens_per_source().items()}
            )
        scheduler = self.lr_schedulers()
        assert isinstance(scheduler, LRScheduler)  # configure_optimizers's one
        metrics["train/lr"] = float(scheduler.get_last_lr()[0])
        values = {k: torch.tensor(v) for k, v in metrics.items()}  # on the host: no read of them waits
        lightning_compat.log_metrics(self.trainer, values, callback=True)  # equal on every rank

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,  # always "norm" (TrainerConfig has no other)
    ) -> None:
        """Clip to ``gradient_clip_val`` by the global norm, with the step's norm (computed once per step)."""
        if not gradient_clip_val:
            return
        assert self.step_loss is not None
        params = _optimized(optimizer)
        norm = self.step_loss.grad_norm(params)
        if norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

    # ------------------------------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        inputs, labels = self._split(batch)
        with vocabulary_parallel(self.tensor_parallel):
            logits = self.model(**inputs).logits
            metrics = self.objective.metrics(logits, labels)
        self.flops_per_batch = self._batch_flops(inputs, backward=False)
        for key, value in metrics.items():
            self._val_sums[key] = self._val_sums.get(key, 0) + value.float()

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        keys = sorted(self._val_sums)
        totals = dict(zip(keys, self._reduce(torch.stack([self._val_sums[k] for k in keys]))))
        metrics = {f"val/{k}": v for k, v in self.objective.summarize(totals).items()}
        self.log_dict(
            metrics, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True
        )  # equal on all ranks

    # ------------------------------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        offload = optimizer_offloaded(self.run)
        # only fp16's loss scaler needs the gradients unscaled before clipping: bf16-mixed can use the fused AdamW
        # (configure_gradient_clipping clips without Lightning's AMP plugin, which refuses fused optimizers)
        amp = self.run.trainer.precision.startswith("16")
        optimizer = build_optimizer(
            self.model, self.run.optim, cpu_offload=offload, amp=amp, width_mult=self.run.model.width_mult
        )
        rank_zero_info(describe(optimizer))
        self.decayed_tensors = sum(len(g["params"]) for g in optimizer.param_groups if g["weight_decay"] > 0)
        self.base_lrs = [
            g["lr"] for g in optimizer.param_groups
        ]  # the config's (a resume may restart from them)
        scheduler = build_scheduler(optimizer, self.run.optim, self.run.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_param_names(self) -> list[list[str]]:
        """The parameter names (``model.*``) of each optimizer group in the order ``configure_optimizers`` builds
        them: what the numbered optimizer state of a checkpoint file refers to."""
        return group_param_names(
            self.run.model, self.run.optim.weight_decay, muon=self.run.optim.name == "muon"
        )

    # ------------------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[PAYLOAD] = {
            "config": self.resolved,
            "tokenizer_json": self.tokenizer_json,
            "wandb_run_id": self.wandb_id,
            "tokens_seen": self.tokens_seen,
            "data_keys": self.data_keys,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        apply_resume_changes(self, checkpoint)
        self.tokens_seen = int(checkpoint.get(PAYLOAD, {}).get("tokens_seen", 0))


def _optimized(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` updates, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
