"""A finetuning run: build backbone, data and module (every input error surfaces there), train, evaluate the
whole validation file, write ``results.json`` and ``finetuned.pt``."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
from tokenizers import Tokenizer

from pretrain.errors import InputError
from pretrain.finetuning.backbone import freeze, load_backbone
from pretrain.finetuning.checkpoint import finetune_payload, save_finetuned
from pretrain.finetuning.config import FinetuneConfig
from pretrain.finetuning.data import build_datamodule
from pretrain.finetuning.module import FinetuneModule, Text2TextModule
from pretrain.io import atomic_write_text
from pretrain.models.heads import TaskModel

if TYPE_CHECKING:
    from pretrain.datamodules.finetune import FinetuneDataModule
    from pretrain.datamodules.text2text import Text2TextDataModule


@dataclass(frozen=True)
class FinetuneParts:
    """What :func:`build_parts` builds for a finetuning run."""

    module: FinetuneModule | Text2TextModule
    datamodule: FinetuneDataModule | Text2TextDataModule
    tokenizer: Tokenizer  # the backbone's
    roles: dict[str, str]  # special-token roles: the backbone's, then data.special_tokens
    label_names: list[str] | None  # a head's classes (None: text2text)


def build_parts(cfg: FinetuneConfig) -> FinetuneParts:
    """Backbone, tokenizer, datamodule (read and checked) and LightningModule; every input error surfaces here."""
    L.seed_everything(cfg.seed, verbose=False)  # before a randomly initialised backbone is built
    backbone, tokenizer, roles = load_backbone(cfg.init)
    backbone.check_inputs = (
        False  # load_backbone checked the tokenizer/vocab fit, check_lengths the positions
    )
    roles = roles | dict(cfg.data.special_tokens)
    check_lengths(cfg, backbone.config)
    datamodule = build_datamodule(cfg, tokenizer, backbone.config.arch, roles)
    datamodule.setup("fit")
    freeze(backbone, cfg.freeze.embeddings, cfg.freeze.layers)
    if cfg.lora is not None:
        from pretrain.finetuning.lora import add_lora

        add_lora(backbone, cfg.lora)
    if cfg.head.kind == "text2text":
        from pretrain.datamodules.special_tokens import special_token_id

        eos, pad = (special_token_id(tokenizer, r, roles) for r in ("eos", "pad"))
        module: Text2TextModule | FinetuneModule = Text2TextModule(
            backbone, cfg, tokenizer, eos_id=eos, pad_id=pad
        )
        labels = None
    else:
        regression = datamodule.format.regression
        labels = datamodule.label_names
        model = TaskModel(
            backbone, cfg.head.kind, datamodule.num_labels, pooling=cfg.head.pooling, dropout=cfg.head.dropout
        )
        module = FinetuneModule(model, cfg, num_labels=datamodule.num_labels, regression=regression)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from pretrain.finetuning.lora import trainable_summary

    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # Lightning sets the rank on the function
        print(trainable_summary(module.model))
    return FinetuneParts(
        module=module, datamodule=datamodule, tokenizer=tokenizer, roles=roles, label_names=labels
    )


def check_lengths(cfg: FinetuneConfig, model: Any) -> None:
    """Encoded examples fit the backbone's position table (learned / sinusoidal positions stop at max_seq_len)."""
    if model.position not in ("learned", "sinusoidal"):
        return
    lengths = [("data.max_length", cfg.data.max_length)]
    if cfg.head.kind == "text2text":
        lengths.append(("data.max_target_length", cfg.data.max_target_length + 1))  # + the decoder start
    for name, value in lengths:
        if value > model.max_seq_len:
            where = (
                f"the max_seq_len of {cfg.init.checkpoint}"
                if cfg.init.checkpoint
                else "init.model.max_seq_len"
            )
            raise InputError(
                f"{name}={value} exceeds the backbone's {model.max_seq_len} positions ({where}); set "
                f"{name}={model.max_seq_len} or lower"
            )


def run(cfg: FinetuneConfig) -> dict[str, Any]:
    """Train under ``cfg.strategy`` with `pretrain fit`'s Trainer (``build_trainer``: DDP, FSDP2, DeepSpeed ZeRO;
    ``last.ckpt`` every ``checkpoint.every_n_steps``, resumed by ``resume``), evaluate the whole validation
    file, write ``results.json`` (and ``finetuned.pt``); return the results. One writer of ``run_dir``."""
    from pretrain.io import run_lock

    with run_lock(cfg.run_path, "`pretrain finetune`"):
        return _run(cfg)


def _run(cfg: FinetuneConfig) -> dict[str, Any]:
    from pretrain.checkpoint.io import payload
    from pretrain.checkpoint.resume import check_resumable, check_trainable, compare_for_resume
    from pretrain.datamodules.finetune import FinetuneDataModule
    from pretrain.finetuning.checkpoint import FINETUNE_RESUME
    from pretrain.finetuning.lora import parameter_counts
    from pretrain.training.quiet import data_position_restored
    from pretrain.training.setup import continued_wandb_id, new_run_id, resume_path, set_aside_checkpoints
    from pretrain.training.trainer import build_trainer

    ckpt = resume_path(cfg)
    if cfg.resume is None:
        set_aside_checkpoints(cfg)
    changes: list[str] = []
    wandb_id = None
    if ckpt is not None:  # before the backbone and the data are read
        check_resumable(cfg.strategy.name, ckpt)
        check_trainable(ckpt)
        saved, current = payload(ckpt), {"finetune": dataclasses.asdict(cfg)}
        changes = compare_for_resume(FINETUNE_RESUME, saved, current, cfg.resume_allow, ckpt)
        wandb_id = continued_wandb_id(ckpt, saved, cfg.run_path)
    parts = build_parts(cfg)
    module, datamodule = parts.module, parts.datamodule
    module.resume_changes = frozenset(changes)
    # a head's checkpoints carry the tokenizer with the run's template and truncation: exported, it encodes as
    # training did (`[CLS] A [SEP]` ...); text-to-text keeps the backbone's
    tokenizer = datamodule.tokenizer if isinstance(datamodule, FinetuneDataModule) else parts.tokenizer
    module.payload = finetune_payload(cfg, module.model, tokenizer, parts.roles, parts.label_names)
    # the W&B run a resume continues (before: every launch started a W&B run of its own)
    module.payload["wandb_run_id"] = wandb_id = wandb_id or new_run_id()
    trainer = build_trainer(cfg, dataclasses.asdict(cfg), wandb_id=wandb_id)
    start = time.perf_counter()
    with data_position_restored():  # FinetuneDataModule's state: epoch and batches
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    train_seconds = time.perf_counter() - start
    results: dict[str, Any] = {
        "name": cfg.name,
        "steps": trainer.global_step,
        "train_seconds": round(train_seconds, 1),
        "trainable_parameters": parameter_counts(module.model)[0],
    }
    if datamodule.val_dataloader():  # the whole file, each example once over the ranks
        trainer.limit_val_batches = 1.0
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
        results["val"] = {k.removeprefix("val/"): float(v) for k, v in metrics.items()}
    trainer.strategy.barrier()  # every rank's part of last.ckpt is written
    if trainer.is_global_zero:
        out = cfg.run_path
        out.mkdir(parents=True, exist_ok=True)
        if cfg.save:
            save_finetuned(out / "finetuned.pt", cfg.checkpoint_dir / "last.ckpt")
        atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    return results
