"""Finetuning checkpoints: the section ``last.ckpt`` carries (``finetune_payload``: the backbone's config and
tokenizer as `pretrain fit` writes them, so `pretrain export` reads a text-to-text checkpoint, plus the finetuning
config and labels), and ``finetuned.pt``: the finetuned weights with everything needed to rebuild the model,
consolidated from the run's checkpoint under any strategy; loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from pretrain.finetuning.config import FinetuneConfig
from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel
from pretrain.models.transformer import Transformer


def finetune_payload(
    cfg: FinetuneConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    roles: dict[str, str],
    label_names: list[str] | None,
) -> dict[str, Any]:
    """The run's section of every checkpoint (``pretrain.training.checkpoint.PAYLOAD``)."""
    backbone = model.backbone if isinstance(model, TaskModel) else model
    return {
        "config": {"model": dataclasses.asdict(backbone.config), "tokenizer": {"special_tokens": roles}},
        "tokenizer_json": tokenizer.to_str(),
        "finetune": dataclasses.asdict(cfg),
        "label_names": label_names,
        "num_outputs": model.head.out.out_features if isinstance(model, TaskModel) else None,
    }


def save_finetuned(path: Path, checkpoint: Path) -> None:
    """``finetuned.pt`` from a finetuning run's checkpoint: a file, or a sharded FSDP / DeepSpeed directory
    (consolidated with ``pretrain.training.checkpoint.consolidate``)."""
    from pretrain.training.checkpoint import PAYLOAD, consolidate, model_state, read

    with tempfile.TemporaryDirectory() as tmp:
        saved = read(consolidate(checkpoint, Path(tmp) / "consolidated.ckpt"))
    info = saved[PAYLOAD]
    torch.save(
        {
            "state_dict": model_state(saved),
            "config": info["finetune"],
            "model_config": info["config"]["model"],
            "tokenizer_json": info["tokenizer_json"],
            "label_names": info["label_names"],
            "num_outputs": info["num_outputs"],
        },
        path,
    )


def load_finetuned(path: str | Path) -> tuple[nn.Module, dict[str, Any], Tokenizer]:
    """``(model in eval mode, saved payload, tokenizer)`` of a ``finetuned.pt`` (``torch.load(weights_only=True)``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    backbone = Transformer(ModelConfig(**payload["model_config"]))
    head = payload["config"]["head"]
    model: nn.Module = backbone
    if head["kind"] != "text2text":
        model = TaskModel(backbone, head["kind"], payload["num_outputs"], pooling=head["pooling"])
    model.load_state_dict(payload["state_dict"])
    return model.eval(), payload, Tokenizer.from_str(payload["tokenizer_json"])
