"""Checkpoint conversion: a sharded (FSDP / DeepSpeed) checkpoint consolidated into one file, optimizer state
between position- and name-keyed layouts, and the backbone loaded for inference."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.training.checkpoint.io import METADATA, PAYLOAD, AtomicCheckpointIO, kind, read


def optimizer_state_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``torch.distributed.checkpoint.state_dict``'s layout: ``state`` by parameter
    name, groups listing names) in ``torch.optim.Optimizer.state_dict``'s layout: parameters numbered in the
    order the groups list them."""
    numbers: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [numbers.setdefault(n, len(numbers)) for n in group["params"]]})
    return {"state": {numbers[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_by_position` for ``optimizer`` over ``model``'s parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    by_number: dict[int, str] = {}
    groups = []
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        by_number.update(zip(saved["params"], (names[id(p)] for p in live["params"]), strict=True))
        groups.append({**saved, "params": [by_number[i] for i in saved["params"]]})
    return {"state": {by_number[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def consolidate(path: str | Path, output: str | Path) -> Path:
    """One-file checkpoint from a sharded one, in the layout of a single-process run's checkpoint (it resumes a
    run under any strategy). FSDP shards are read with ``torch.distributed.checkpoint``; DeepSpeed ZeRO
    directories need ``deepspeed`` (its files are trusted pickles; weights only). A file is returned unchanged."""
    path, output = Path(path), Path(output)
    found = kind(path)
    if found == "file":
        return path
    if found == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            shards = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
        checkpoint = read(path / METADATA)
        checkpoint["state_dict"] = shards["state_dict"]
        checkpoint["optimizer_states"] = [
            optimizer_state_by_position(shards[k]) for k in sorted(shards) if k.startswith("optimizer_")
        ]
        AtomicCheckpointIO().save_checkpoint(checkpoint, output)
        return output
    try:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ValueError("consolidating a DeepSpeed checkpoint needs `pip install deepspeed`") from err
    convert_zero_checkpoint_to_fp32_state_dict(path, output)
    return output


def model_state(checkpoint: dict[str, Any], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The backbone's weights from a Lightning ``state_dict`` (``PretrainModule.model`` -> keys ``model.*``)."""
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def load_model(path: str | Path) -> tuple[Transformer, dict[str, Any], Tokenizer | None]:
    """``(model in eval mode, payload, tokenizer)`` from a checkpoint file or a sharded checkpoint directory."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        single = consolidate(path, Path(tmp) / "consolidated.ckpt") if path.is_dir() else path
        checkpoint = read(single)
    if PAYLOAD not in checkpoint:
        raise ValueError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    info = checkpoint[PAYLOAD]
    model = Transformer(ModelConfig(**info["config"]["model"]))
    model.load_state_dict(model_state(checkpoint))
    tokenizer = Tokenizer.from_str(info["tokenizer_json"]) if info.get("tokenizer_json") else None
    return model.eval(), info, tokenizer
