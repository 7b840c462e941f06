"""The finetuning LightningModules: ``FinetuneModule`` (a task head on a backbone: classes or regression)
and ``Text2TextModule`` (an encoder-decoder's own LM head on source -> target text, scored on decoded outputs)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from tokenizers import Tokenizer
from torch import Tensor, nn

from pretrain.checkpoint.resume import apply_resume_changes, restart_schedules
from pretrain.errors import InputError
from pretrain.finetuning.config import FinetuneConfig
from pretrain.finetuning.decoding import decode_targets
from pretrain.finetuning.metrics import TEXT_METRICS, build_metrics, default_metrics
from pretrain.models.heads import Packing, TaskModel
from pretrain.models.transformer import Transformer
from pretrain.objectives.loss import IGNORE_INDEX
from pretrain.optim import param_groups
from pretrain.training.step import FreeGradientsAfterStep, StepLossHooks


def finetune_optimizer(
    cfg: FinetuneConfig, backbone: nn.Module, head: nn.Module | None, max_steps: int
) -> OptimizerLRSchedulerConfig:
    """`pretrain fit`'s optimizer (``pretrain.optim.build_optimizer``: AdamW with no decay on norms, biases
    and embeddings, or Muon for the backbone's hidden matrices) with the head's groups at ``head.lr``, and the
    configured warmup + decay schedule applied to every group."""
    from pretrain.optim import build_optimizer, build_scheduler
    from pretrain.training.strategies import optimizer_offloaded

    o = cfg.optim
    extra = []
    if head is not None:
        for g in param_groups(head, o.weight_decay):
            extra.append(g | {"name": f"head_{g['name']}", "lr": (cfg.head.lr or o.lr) * g["lr_mult"]})
    optimizer = build_optimizer(
        backbone,
        o,
        cpu_offload=optimizer_offloaded(cfg),
        amp=cfg.trainer.precision.startswith("16"),
        extra_groups=extra,
    )
    scheduler = build_scheduler(optimizer, o, max_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _FinetuneBase(StepLossHooks, FreeGradientsAfterStep, L.LightningModule):
    """What both finetuning modules share: the checkpoint payload `pretrain export` / ``finetuned.pt`` read,
    and the loss scale DeepSpeed needs."""

    cfg: FinetuneConfig
    payload: dict[str, Any] | None = None  # set by pretrain.finetuning.run: configs, tokenizer, labels
    resume_changes: frozenset[str] = frozenset()  # resume_allow entries that differ (pretrain.finetuning.run)
    base_lrs: tuple[float, ...] = ()  # each parameter group's base learning rate (configure_optimizers)
    flops_per_batch = 0.0  # model FLOPs of the last training micro-batch (read by the throughput monitor)

    def _count_flops(self, backbone: Transformer, batch: dict[str, Any], lm_head: bool) -> None:
        """``flops_per_batch``: ``Transformer.flops_per_token`` (forward + backward; the LM head only for
        text-to-text, where it is the output layer) times the batch's tokens; cached per shape."""
        B, S = batch["input_ids"].shape
        T = batch["decoder_input_ids"].shape[1] if "decoder_input_ids" in batch else None
        cache = self.__dict__.setdefault("_flops_per_sample", {})
        if (S, T) not in cache:
            cache[S, T] = backbone.flops_per_token(S, T, head_positions=None if lm_head else 0) * S
        self.flops_per_batch = cache[S, T] * B

    def on_train_start(self) -> None:
        self.start_step_loss()
        restart_schedules(self, self.base_lrs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        apply_resume_changes(self, checkpoint)

    def _optimizer(self, backbone: nn.Module, head: nn.Module | None) -> OptimizerLRSchedulerConfig:
        """``finetune_optimizer``; the config's base learning rates kept (a resume may restart from them)."""
        out = finetune_optimizer(self.cfg, backbone, head, self.cfg.trainer.max_steps)
        self.base_lrs = tuple(g["initial_lr"] for g in out["optimizer"].param_groups)
        return out

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from pretrain.checkpoint import PAYLOAD

        if self.payload is not None:
            checkpoint[PAYLOAD] = self.payload


PACKED_TEXT2TEXT_KEYS = (
    "document_ids",
    "position_ids",
    "decoder_attention_mask",
    "decoder_document_ids",
    "decoder_position_ids",
)


def _mask_padding(labels: Tensor, real: Tensor | None) -> Tensor:
    """``labels`` (B, ...) with the rows of padding examples (``real`` False) ignored."""
    if real is None:
        return labels
    return labels.masked_fill(~real.view(-1, *[1] * (labels.dim() - 1)), IGNORE_INDEX)


class FinetuneModule(_FinetuneBase):
    """A ``TaskModel`` trained with cross-entropy (classes; -100 labels ignored, e.g. sub-word tokens) or MSE
    (``regression``: one output); validation logs ``val/loss`` and the configured metrics."""

    def __init__(self, model: TaskModel, cfg: FinetuneConfig, *, num_labels: int, regression: bool):
        super().__init__()
        self.model, self.cfg, self.regression = model, cfg, regression
        self.metrics = build_metrics(default_metrics(cfg, regression), max(num_labels, 2), regression)
        self.val_loss = torchmetrics.MeanMetric()

    def _logits(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model(
            batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"), Packing.of(batch)
        )

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, predictions, labels) with ignored positions removed."""
        logits = self._logits(batch)
        labels, real = batch["labels"], batch.get("real")  # real: False for evaluation padding
        if self.regression:
            scores = logits.squeeze(-1).float()
            if real is not None:
                scores, labels = scores[real], labels[real]
            return F.mse_loss(scores, labels.float()), scores.detach(), labels
        logits, labels = logits.flatten(0, -2), _mask_padding(labels, real).flatten()
        keep = labels != IGNORE_INDEX
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
        return loss, logits.detach().argmax(-1)[keep], labels[keep]

    def _training_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """The loss alone (training batches have no padding rows): no predictions picked out by a boolean mask,
        which would wait for the device."""
        logits = self._logits(batch)
        if self.regression:
            return F.mse_loss(logits.squeeze(-1).float(), batch["labels"].float())
        return F.cross_entropy(
            logits.flatten(0, -2).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._count_flops(self.model.backbone, batch, lm_head=False)
        loss = self._training_loss(batch)
        # equal micro-batches on every rank: the mean over ranks is the global batch's loss
        self.log("train/loss", loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        return self.step_mean(loss, batch_idx)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, preds, labels = self._loss(batch)
        if labels.numel():  # a batch of padding only (sharded evaluation) adds nothing
            self.val_loss.update(loss, weight=labels.numel())
            self.metrics.update(preds, labels)

    def on_validation_epoch_end(self) -> None:
        values = {f"val/{k}": v for k, v in self.metrics.compute().items()} | {
            "val/loss": self.val_loss.compute()
        }
        self.log_dict(values, prog_bar=True)
        self.metrics.reset()
        self.val_loss.reset()

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        return self._optimizer(self.model.backbone, self.model.head)


class Text2TextModule(_FinetuneBase):
    """Encoder-decoder trained on target tokens (mean cross-entropy); validation decodes every source and scores
    the texts against the references: ``val/accuracy`` (exact match) and/or ``val/bleu`` (sacrebleu corpus BLEU)."""

    def __init__(
        self, model: Transformer, cfg: FinetuneConfig, tokenizer: Tokenizer, *, eos_id: int, pad_id: int
    ):
        super().__init__()
        if model.config.arch != "encoder-decoder" or not model.config.lm_head:
            raise InputError(
                f"head.kind=text2text needs an encoder-decoder backbone with an LM head (T5), got arch "
                f"{model.config.arch!r}; use head.kind=sequence for encoders and decoders"
            )
        self.metric_names = default_metrics(cfg, regression=False)
        if not self.metric_names or any(m not in TEXT_METRICS for m in self.metric_names):
            raise InputError(f"text2text metrics must be among {list(TEXT_METRICS)}, got {self.metric_names}")
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.eos_id, self.pad_id = eos_id, pad_id
        self.val_loss = torchmetrics.MeanMetric()
        self.hypotheses: list[str] = []
        self.references: list[str] = []

    def _loss_sum(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(summed target-token cross-entropy, number of target tokens)."""
        packed = {k: batch[k] for k in PACKED_TEXT2TEXT_KEYS if k in batch}  # unpadded batches
        logits = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
            **packed,
        ).logits
        labels = _mask_padding(batch["labels"], batch.get("real")).flatten()
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss, (labels != IGNORE_INDEX).sum()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """The mean over the target tokens of all data-parallel ranks: each rank's sum over the global count,
        times W (data-parallel gradient averaging divides by W)."""
        self._count_flops(self.model, batch, lm_head=True)
        loss_sum, count = self._loss_sum(batch)
        world = self.trainer.world_size
        total = self.trainer.strategy.reduce(count.float(), reduce_op="sum") if world > 1 else count
        loss = loss_sum / total.clamp_min(1)
        self.log("train/loss", loss.detach(), prog_bar=True, reduce_fx="sum", sync_dist=world > 1)
        return self.step_mean(loss * world, batch_idx)

    def _all_ranks_finished(self) -> Any:
        """Decoding (greedy, sampled or beam) stops when every rank's has: each step is a forward pass, a
        collective when the model is sharded (FSDP, ZeRO-3); one code path for every strategy."""
        if self.trainer.world_size == 1:
            return None

        def finished(rows: Tensor) -> bool:
            flag = rows.all().float()
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            return bool(flag > 0)

        return finished

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss_sum, count = self._loss_sum(batch)
        if count:
            self.val_loss.update(loss_sum / count, weight=int(count))
        tokens = decode_targets(
            self.model, batch, self.cfg.decoding, self.eos_id, self.pad_id, self._all_ranks_finished()
        )
        texts = self.tokenizer.decode_batch(tokens.tolist(), skip_special_tokens=True)
        real = batch.get("real", torch.ones(len(texts), dtype=torch.bool)).tolist()
        self.hypotheses += [t.strip() for t, r in zip(texts, real, strict=True) if r]
        self.references += [t for t, r in zip(batch["targets"], real, strict=True) if r]

    def on_validation_epoch_end(self) -> None:
        values = {"val/loss": self.val_loss.compute()}
        if self.trainer.world_size > 1:  # every rank decoded its shard of the file
            shards: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(shards, (self.hypotheses, self.references))
            self.hypotheses = [h for hypotheses, _ in shards for h in hypotheses]
            self.references = [r for _, references in shards for r in references]
        pairs = list(zip(self.hypotheses, self.references, strict=True))
        if "accuracy" in self.metric_names:
            values["val/accuracy"] = torch.tensor(sum(h == r for h, r in pairs) / max(len(pairs), 1))
        if "bleu" in self.metric_names:
            import sacrebleu

            values["val/bleu"] = torch.tensor(sacrebleu.corpus_bleu(self.hypotheses, [self.references]).score)
        self.log_dict(values, prog_bar=True)
        self.val_loss.reset()
        self.hypotheses, self.references = [], []

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        return self._optimizer(self.model, None)
