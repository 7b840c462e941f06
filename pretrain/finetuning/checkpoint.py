"""``finetuned.pt``: the finetuned weights with everything needed to rebuild the model (config, tokenizer,
label names); loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import torch
from tokenizers import Tokenizer
from torch import nn

from pretrain.finetuning.config import FinetuneConfig
from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel
from pretrain.models.transformer import Transformer


def save_finetuned(
    path: Path,
    cfg: FinetuneConfig,
    module: L.LightningModule,
    tokenizer: Tokenizer,
    label_names: list[str] | None,
) -> None:
    """Weights + everything needed to rebuild the model (``load_finetuned``); loadable with weights_only=True."""
    model = module.model
    backbone = model.backbone if isinstance(model, TaskModel) else model
    torch.save(
        {
            "state_dict": model.state_dict(),
            "config": dataclasses.asdict(cfg),
            "model_config": dataclasses.asdict(backbone.config),
            "tokenizer_json": tokenizer.to_str(),
            "label_names": label_names,
            "num_outputs": model.head.out.out_features if isinstance(model, TaskModel) else None,
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
