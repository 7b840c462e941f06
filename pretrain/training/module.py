"""``PretrainModule``: the backbone + an objective as a LightningModule, with a globally normalised loss.

Loss normalisation. An optimizer step sees micro-batches m = 1..k on ranks r = 1..W; the objective returns
``S_{r,m}`` (summed token cross-entropy) and ``N_{r,m}`` (number of targets). The step's loss is

    L = sum_{r,m} S_{r,m} / N,    N = sum_{r,m} N_{r,m}

which is *not* the mean of per-micro-batch means when the target counts vary (MLM, span corruption, padding).
``StepGroups`` looks k micro-batches ahead and tags each with its step's local target count; the module
all-reduces that count once per step (giving N) and backpropagates ``S_{r,m} * k * W / N``: Lightning divides
each micro-batch loss by k, data-parallel gradient averaging divides by W, so the accumulated gradient is
exactly the gradient of L -- the same as one pass over the whole global batch.

Randomness. Dropout draws from the global torch generator, which is re-seeded before every micro-batch from
(seed, optimizer step, micro-batch, rank): a resumed run replays the same dropout masks with no RNG state
to carry, whatever ran in between (validation, data-loader start-up).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from datamodules.pretrain import PretrainDataModule
from objectives import IGNORE_INDEX, Objective
from pretrain.config import RunConfig
from pretrain.models.transformer import Transformer
from pretrain.training import lightning_compat
from pretrain.training.checkpoint import PAYLOAD
from pretrain.training.optim import build_optimizer, build_scheduler, describe
from pretrain.training.strategies import optimizer_offloaded

STEP_TARGETS = (
    "step_num_targets"  # batch key added by StepGroups: targets in this rank's micro-batches of the step
)
TARGET_POSITIONS = (
    "target_positions"  # (N,) flat indices of the labelled positions (sparse-target objectives)
)


class StepGroups:
    """Micro-batches of ``loader`` in groups of ``k`` (one optimizer step), each tagged with the group's number
    of targets (``labels != -100``). A trailing incomplete group is dropped so every step has k micro-batches."""

    def __init__(self, loader: Iterable[dict[str, Tensor]], k: int):
        self.loader, self.k = loader, k
        self.sampler = getattr(loader, "sampler", None)  # Lightning calls sampler.set_epoch

    def __len__(self) -> int:
        return len(self.loader) // self.k * self.k

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        batches = iter(self.loader)
        while len(group := list(itertools.islice(batches, self.k))) == self.k:
            count = sum((b["labels"] != IGNORE_INDEX).sum() for b in group)
            for batch in group:
                yield {**batch, STEP_TARGETS: count}


class PretrainData(PretrainDataModule):
    """``PretrainDataModule`` whose training batches come in optimizer-step groups (see ``StepGroups``)."""

    def __init__(self, *args: Any, accumulate_grad_batches: int = 1, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.accumulate_grad_batches = accumulate_grad_batches

    @property
    def batches_per_epoch(self) -> int:
        """Whole optimizer steps only: ``StepGroups`` drops an epoch's trailing incomplete group."""
        k = self.accumulate_grad_batches
        return super().batches_per_epoch // k * k

    def train_dataloader(self) -> StepGroups:
        return StepGroups(super().train_dataloader(), self.accumulate_grad_batches)

    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        """Drop attention masks that mask nothing (packed samples have no padding), still on the CPU: the
        backbone then calls SDPA without an explicit mask (``is_causal`` for decoders), allowing FlashAttention.
        For an objective with ``sparse_targets`` add ``target_positions`` (N,), the flat indices of the labelled
        positions, so the LM head runs on those only; found here on the CPU, the device never waits for it."""
        for key in ("attention_mask", "decoder_attention_mask"):
            if key in batch and bool(batch[key].all()):
                del batch[key]
        if self.objective.sparse_targets and "labels" in batch:
            batch[TARGET_POSITIONS] = (batch["labels"].flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        return batch


def dropout_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, micro_batch, rank]).generate_state(1, np.uint64)[0] >> 1)


class PretrainModule(L.LightningModule):
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
    ):
        super().__init__()
        objective.check_architecture(run.model.arch)
        self.run, self.objective, self.resolved = run, objective, resolved
        self.tokenizer_json, self.wandb_id = tokenizer_json, wandb_id
        self.model = Transformer(run.model)
        self.model.check_inputs = False  # the tokenizer/vocab fit is checked once before training
        self.model.gradient_checkpointing = run.trainer.activation_checkpointing
        if run.trainer.compile:
            self.model.compile()  # compiles __call__ in place: parameter names and state_dict unchanged
        self.tokens_seen = 0
        self.flops_per_batch = 0.0  # read by the ThroughputMonitor after every batch
        with torch.device(
            "meta"
        ):  # shapes only: FLOPs of the whole model, whatever shards the strategy makes
            self._flops_per_token = Transformer(run.model).flops_per_token
        self.decayed_tensors = 0  # weight-decayed parameter tensors (set by configure_optimizers)
        self._flops_per_sample: dict[tuple[int, int | None], tuple[float, float]] = {}
        self._step_targets: Tensor | None = None
        self._train_sums: dict[str, Tensor] = {}
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
        ``target_positions`` only; cached per shape."""
        batch, seq = inputs["input_ids"].shape
        dec = inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in inputs else None
        if (seq, dec) not in self._flops_per_sample:  # (all positions, without the head)
            self._flops_per_sample[seq, dec] = tuple(
                self._flops_per_token(seq, dec, head_positions=h) * seq for h in (None, 0)
            )
        full, headless = self._flops_per_sample[seq, dec]
        flops = full * batch
        if TARGET_POSITIONS in inputs:
            head_per_position = (full - headless) / (dec or seq)
            flops = headless * batch + head_per_position * len(inputs[TARGET_POSITIONS])
        return flops if backward else flops / 3

    def _reduce(self, t: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(t, reduce_op="sum") if self.trainer.world_size > 1 else t

    def _grad_multiplier(self) -> int:
        """k * W, undoing Lightning's division by k and data-parallel averaging over W. DeepSpeed's engine
        divides by its gradient-accumulation steps once more."""
        k = self.trainer.accumulate_grad_batches
        twice = lightning_compat.engine_divides_by_accumulation(self.trainer.strategy)
        return k * self.trainer.world_size * (k if twice else 1)

    # ------------------------------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        k = self.trainer.accumulate_grad_batches
        micro = batch_idx % k
        torch.manual_seed(dropout_seed(self.run.seed, self.global_step, micro, self.global_rank))
        if micro == 0:
            self._step_targets = self._reduce(batch[STEP_TARGETS].clone())
            self._train_sums = {}
        inputs, labels = self._split(batch)
        logits = self.model(**inputs).logits
        loss_sum, _ = self.objective.loss(logits, labels)
        self.flops_per_batch = self._batch_flops(inputs, backward=True)
        self.tokens_seen += inputs["input_ids"].numel() * self.trainer.world_size

        if lightning_compat.should_update_logs(self.trainer):
            correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
            for key, value in (("loss_sum", loss_sum.detach()), ("num_correct", correct)):
                self._train_sums[key] = self._train_sums.get(key, 0) + value
            if micro == k - 1:
                self._log_train_step()
        return loss_sum * self._grad_multiplier() / self._step_targets.clamp_min(1)

    def _log_train_step(self) -> None:
        loss_sum, correct = self._reduce(
            torch.stack([self._train_sums[k].float() for k in ("loss_sum", "num_correct")])
        )
        totals = {"loss_sum": loss_sum, "num_correct": correct, "num_targets": self._step_targets}
        metrics = {f"train/{k}": v for k, v in self.objective.summarize(totals).items()}
        metrics["train/tokens_seen"] = float(self.tokens_seen)
        metrics["train/lr"] = self.lr_schedulers().get_last_lr()[0]
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, rank_zero_only=True)
        self.log("loss", metrics["train/loss"], prog_bar=True, logger=False, rank_zero_only=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log the global gradient norm (before clipping); sharded (DTensor) gradients are reduced over ranks."""
        if not lightning_compat.should_update_logs(self.trainer):
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:  # DeepSpeed keeps gradients inside its engine
            return
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm of this rank's shards, made global
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False, rank_zero_only=True)

    # ------------------------------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        inputs, labels = self._split(batch)
        logits = self.model(**inputs).logits
        self.flops_per_batch = self._batch_flops(inputs, backward=False)
        for key, value in self.objective.metrics(logits, labels).items():
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
    def configure_optimizers(self) -> dict[str, Any]:
        offload = optimizer_offloaded(self.run)
        amp = self.run.trainer.precision.endswith("-mixed")
        optimizer = build_optimizer(
            self.model, self.run.optim, cpu_offload=offload, amp=amp, width_mult=self.run.model.width_mult
        )
        rank_zero_info(describe(optimizer))
        self.decayed_tensors = sum(len(g["params"]) for g in optimizer.param_groups if g["weight_decay"] > 0)
        scheduler = build_scheduler(optimizer, self.run.optim, self.run.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[PAYLOAD] = {
            "config": self.resolved,
            "tokenizer_json": self.tokenizer_json,
            "wandb_run_id": self.wandb_id,
            "tokens_seen": self.tokens_seen,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get(PAYLOAD, {}).get("tokens_seen", 0))
