"""A finetuning run: build backbone, data and module (every input error surfaces there), train, evaluate the
whole validation file, write ``results.json`` and ``finetuned.pt``."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L

from pretrain.finetuning.backbone import freeze, load_backbone
from pretrain.finetuning.checkpoint import save_finetuned
from pretrain.finetuning.config import FinetuneConfig
from pretrain.finetuning.data import build_datamodule
from pretrain.finetuning.module import FinetuneModule, Text2TextModule
from pretrain.models.heads import TaskModel
from pretrain.training.progress import progress_callbacks
from pretrain.training.quiet import quiet_libraries


def build_parts(cfg: FinetuneConfig) -> dict[str, Any]:
    """Backbone, tokenizer, datamodule (read and checked) and LightningModule; every input error surfaces here."""
    L.seed_everything(cfg.seed, verbose=False)  # before a randomly initialised backbone is built
    backbone, tokenizer, roles = load_backbone(cfg.init)
    roles = roles | dict(cfg.data.special_tokens)
    check_lengths(cfg, backbone.config)
    datamodule = build_datamodule(cfg, tokenizer, backbone.config.arch, roles)
    datamodule.setup("fit")
    freeze(backbone, cfg.freeze.embeddings, cfg.freeze.layers)
    if cfg.head.kind == "text2text":
        from datamodules.special_tokens import special_token_id

        eos, pad = (special_token_id(tokenizer, r, roles) for r in ("eos", "pad"))
        module = Text2TextModule(backbone, cfg, tokenizer, eos_id=eos, pad_id=pad)
        labels = None
    else:
        regression = datamodule.format.regression
        labels = datamodule.label_names
        model = TaskModel(
            backbone, cfg.head.kind, datamodule.num_labels, pooling=cfg.head.pooling, dropout=cfg.head.dropout
        )
        module = FinetuneModule(model, cfg, num_labels=datamodule.num_labels, regression=regression)
    return {"module": module, "datamodule": datamodule, "tokenizer": tokenizer, "label_names": labels}


def check_lengths(cfg: FinetuneConfig, model: Any) -> None:
    """Encoded examples fit the backbone's position table (learned / sinusoidal positions stop at max_seq_len)."""
    if model.position not in ("learned", "sinusoidal"):
        return
    lengths = [("data.max_length", cfg.data.max_length)]
    if cfg.head.kind == "text2text":
        lengths.append(("data.max_target_length", cfg.data.max_target_length + 1))  # + the decoder start
    for name, value in lengths:
        if value > model.max_seq_len:
            raise ValueError(
                f"{name}={value} exceeds the backbone's {model.max_seq_len} positions (model.max_seq_len of "
                f"{cfg.init.checkpoint or 'init.model'}); set {name}={model.max_seq_len} or lower"
            )


def run(cfg: FinetuneConfig) -> dict[str, Any]:
    """Train, evaluate the whole validation file, write ``results.json`` (and ``finetuned.pt``); return the results."""
    from lightning.pytorch.loggers import CSVLogger

    parts = build_parts(cfg)
    module, datamodule = parts["module"], parts["datamodule"]
    t = cfg.trainer
    quiet_libraries()
    progress, progress_bar = progress_callbacks(t.progress_bar, t.progress_seconds)
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        use_distributed_sampler=False,  # the datamodules shard by rank (datamodules.finetune.data_parallel_loader)
        precision=t.precision,
        enable_model_summary=False,
        max_steps=t.max_steps,
        max_epochs=-1,
        max_time=timedelta(minutes=t.max_time_minutes) if t.max_time_minutes else None,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        logger=CSVLogger(cfg.run_dir, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        callbacks=progress,
        default_root_dir=cfg.run_dir,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    train_seconds = time.perf_counter() - start
    results: dict[str, Any] = {
        "name": cfg.name,
        "steps": trainer.global_step,
        "train_seconds": round(train_seconds, 1),
    }
    if datamodule.val_dataloader():  # the whole file, each example once over the ranks
        trainer.limit_val_batches = 1.0
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
        results["val"] = {k.removeprefix("val/"): float(v) for k, v in metrics.items()}
    if trainer.is_global_zero:
        out = Path(cfg.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        if cfg.save:
            save_finetuned(out / "finetuned.pt", cfg, module, parts["tokenizer"], parts["label_names"])
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def build_strategy(cfg: FinetuneConfig) -> Any:
    """``auto`` or Lightning's ``DDPStrategy`` from ``cfg.strategy``."""
    s = cfg.strategy
    if s.name == "auto":
        return "auto"
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(
        find_unused_parameters=s.ddp.find_unused_parameters,
        static_graph=s.ddp.static_graph,
        process_group_backend=s.ddp.process_group_backend,
    )
