"""Finetuning checkpoints: the section every checkpoint carries (``finetune_payload``: the backbone's config and
tokenizer as `pretrain fit` writes them, so `pretrain export` reads a text-to-text checkpoint, plus the finetuning
config and labels), and ``finetuned.pt``: the finetuned weights (LoRA merged) with everything needed to rebuild
the model, consolidated from the run's checkpoint under any strategy; loaded with
``torch.load(weights_only=True)``."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from pretrain.checkpoint.resume import (
    MISSING,
    Compared,
    at,
    config_keys,
    file_keys,
    lr_schedule_values,
    optimizer_values,
)
from pretrain.finetuning.config import FinetuneConfig
from pretrain.io import atomic_write
from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel
from pretrain.models.transformer import Transformer


def _lora(payload: dict[str, Any]) -> dict[str, Any]:
    lora = at(payload, "finetune.lora")
    if lora is MISSING:
        return {}
    return {"lora": None if lora is None else {k: lora[k] for k in ("r", "alpha", "target_modules")}}


def _examples(payload: dict[str, Any]) -> dict[str, Any]:
    """What maps a finetuning data position (batches received) to examples, besides the files."""
    ft = payload.get("finetune", {})
    if "data" not in ft:
        return {}
    t = ft["trainer"]
    return {
        "data.micro_batch_size": ft["data"]["micro_batch_size"],
        "ranks (trainer.devices x trainer.num_nodes)": t["devices"] * t["num_nodes"],
    }


DATA_KEYS = (
    "task",
    "train_file",
    "train_target_file",
    "text_columns",
    "label_column",
    "regression",
    "header",
    "template",
    "special_tokens",
    "source_prefix",
    "max_length",
    "max_target_length",
)


def _backbone(payload: dict[str, Any]) -> dict[str, Any]:
    """``init.checkpoint`` and ``init.tokenizer`` as the files they name, ``init.model`` as given."""
    files = file_keys("finetune", "init.checkpoint", "init.tokenizer")(payload)
    return files | config_keys("finetune", "init.model")(payload)


FINETUNE_RESUME = (
    Compared(None, "`seed`", config_keys("finetune", "seed"), "the example order follows the seed"),
    Compared(
        None,
        "`init` (`checkpoint`, `tokenizer`, `model`): the backbone the weights descend from",
        _backbone,
        "the weights and `finetuned.pt` would name another backbone than the one trained",
    ),
    Compared(
        None,
        "`head.kind`, `head.pooling`, `lora` (added or removed, `r`, `alpha`, `target_modules`)",
        lambda payload: config_keys("finetune", "head.kind", "head.pooling")(payload) | _lora(payload),
        "the model's structure and the adapters' scale",
    ),
    Compared(
        "data",
        "`data` files and encoding (`" + "`, `".join(DATA_KEYS) + "`), `data.micro_batch_size`, ranks",
        lambda payload: (
            config_keys("finetune", *(f"data.{k}" for k in DATA_KEYS))(payload) | _examples(payload)
        ),
        "weights, optimizer and step continue; the example order continues from the checkpoint's batch count "
        "over the new data",
    ),
    Compared(
        "optimizer",
        "`optim.name`, `betas`, `eps`, `weight_decay`, `optim.muon.*` but `lr`, `freeze.*`",
        lambda payload: (
            optimizer_values("finetune")(payload)
            | config_keys("finetune", "freeze.embeddings", "freeze.layers")(payload)
        ),
        "optimizer state re-initialised: moments and step counts start from zero with the new settings; "
        "weights, learning-rate schedule position and data continue",
    ),
    Compared(
        "lr_schedule",
        "`optim.lr`, `schedule`, `warmup_steps`, `min_lr_ratio`, `decay_steps` (default `trainer.max_steps`), "
        "`cooldown_fraction` (wsd), `optim.muon.lr`, `head.lr`",
        lambda payload: lr_schedule_values("finetune")(payload) | config_keys("finetune", "head.lr")(payload),
        "the learning rate follows the new schedule from the checkpoint's step on",
    ),
)


def finetune_payload(
    cfg: FinetuneConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    roles: dict[str, str],
    label_names: list[str] | None,
) -> dict[str, Any]:
    """The run's section of every checkpoint (``pretrain.checkpoint.PAYLOAD``)."""
    backbone = model.backbone if isinstance(model, TaskModel) else model
    assert isinstance(backbone, Transformer)
    return {
        "config": {"model": dataclasses.asdict(backbone.config), "tokenizer": {"special_tokens": roles}},
        "tokenizer_json": tokenizer.to_str(),
        "finetune": dataclasses.asdict(cfg),
        "label_names": label_names,
        "num_outputs": model.head.out.out_features if isinstance(model, TaskModel) else None,
    }


def save_finetuned(path: Path, checkpoint: Path) -> None:
    """``finetuned.pt`` from a finetuning run's checkpoint: a file, or a sharded FSDP / DeepSpeed directory
    (consolidated with ``pretrain.checkpoint.consolidate``); LoRA adapters merged. The layout is a
    `pretrain fit` checkpoint's (weights under ``model.``, our section): `pretrain export` reads a text-to-text
    one like a pretrained checkpoint."""
    from pretrain.checkpoint import PAYLOAD, consolidate, read
    from pretrain.checkpoint.convert import model_state

    with tempfile.TemporaryDirectory() as tmp:
        saved = read(consolidate(checkpoint, Path(tmp) / "consolidated.ckpt"))
    info = saved[PAYLOAD]
    state = model_state(saved)
    if info["finetune"].get("lora") and any(".lora_" in k for k in state):  # not merged yet
        state = _merged_lora(state, info)
    payload = {"state_dict": {f"model.{k}": v for k, v in state.items()}, PAYLOAD: info}
    atomic_write(path, lambda tmp: torch.save(payload, tmp))  # a full disk: OSError naming path


def _build(
    model_config: dict[str, Any], head: dict[str, Any], num_outputs: int | None, lora: Any = None
) -> tuple[Transformer | TaskModel, Any]:
    """``(model, LoRA adapters or None)``: the backbone (with ``lora`` injected), under a head unless text2text."""
    backbone = Transformer(ModelConfig(**model_config))
    adapters = None
    if lora is not None:
        from pretrain.finetuning.config import LoRAConfig
        from pretrain.finetuning.lora import add_lora

        adapters = add_lora(backbone, LoRAConfig(**lora))
    if head["kind"] == "text2text":
        return backbone, adapters
    assert num_outputs is not None  # a head's (the payload's num_outputs)
    return TaskModel(backbone, head["kind"], num_outputs, pooling=head["pooling"]), adapters


def _merged_lora(state: dict[str, torch.Tensor], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of a LoRA run with ``W + (alpha / r) B A`` folded in (``pretrain.finetuning.lora.merge``)."""
    from pretrain.finetuning.lora import merge

    ft = info["finetune"]
    model, adapters = _build(info["config"]["model"], ft["head"], info["num_outputs"], ft["lora"])
    model.load_state_dict(state)
    merge(adapters)
    return model.state_dict()


def load_finetuned(path: str | Path) -> tuple[Transformer | TaskModel, dict[str, Any], Tokenizer]:
    """``(model in eval mode, our section, tokenizer)`` of a ``finetuned.pt`` (``torch.load(weights_only=True)``;
    LoRA runs are saved merged: a plain model). The section holds ``finetune`` (the run's config),
    ``label_names``, ``num_outputs`` and the backbone's ``config``."""
    from pretrain.checkpoint import PAYLOAD
    from pretrain.checkpoint.convert import model_state

    saved = torch.load(path, map_location="cpu", weights_only=True)
    info = saved[PAYLOAD]
    model, _ = _build(info["config"]["model"], info["finetune"]["head"], info["num_outputs"])
    model.load_state_dict(model_state(saved))
    return model.eval(), info, Tokenizer.from_str(info["tokenizer_json"])
