"""Checkpoint conversion: a sharded (FSDP / DeepSpeed) checkpoint consolidated into one file or read whole, and
the backbone loaded for inference."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pretrain.checkpoint import dcp
from pretrain.checkpoint.io import METADATA, PAYLOAD, kind, read
from pretrain.checkpoint.optimizer_state import optimizer_count, optimizer_state_by_position
from pretrain.checkpoint.stream import open_source, released_copy, write_single
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


def full_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (a file, a DCP directory, a DeepSpeed directory) in memory, in the layout of a
    single-process run's checkpoint file: ``state_dict`` whole, ``optimizer_states`` by position."""
    path = Path(path)
    found = kind(path)
    if found == "file":
        return read(path)
    if found == "dcp":
        shards = dcp.read(path)
        checkpoint = read(path / METADATA)
        checkpoint["state_dict"] = shards["state_dict"]
        checkpoint["optimizer_states"] = [
            optimizer_state_by_position(shards[f"optimizer_{i}"]) for i in range(optimizer_count(shards))
        ]
        if "ema" in shards:
            checkpoint["ema"] = shards["ema"]
        return checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        return read(consolidate(path, Path(tmp) / "consolidated.ckpt"))


def consolidate(path: str | Path, output: str | Path) -> Path:
    """One-file checkpoint from a sharded one, in the layout of a single-process run's checkpoint (it resumes a
    run under any strategy). DCP shards are read with ``torch.distributed.checkpoint``; DeepSpeed ZeRO
    directories need ``deepspeed`` (its files are trusted pickles; weights only). A file is returned unchanged."""
    path, output = Path(path), Path(output)
    found = kind(path)
    if found == "file":
        return path
    if found == "dcp":  # tensor by tensor: the bytes torch.save writes for full_checkpoint(path)
        with open_source(path) as source:
            return write_single(source, output)
    try:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise InputError("consolidating a DeepSpeed checkpoint needs `pip install deepspeed`") from err
    convert_zero_checkpoint_to_fp32_state_dict(path, output)
    return output


def model_state(checkpoint: dict[str, Any], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The backbone's weights from a Lightning ``state_dict`` (``PretrainModule.model`` -> keys ``model.*``)."""
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def ema_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights' moving average a checkpoint holds (``pretrain.training.callbacks.ema``; parameter name -> whole tensor):
    a file's ``ema``, a DCP directory's ``ema.*`` shards, a DeepSpeed directory's (in ``meta.pt``, or ZeRO-3's
    per-rank partition files put together). ``ValueError`` when it holds none."""
    path = Path(path)
    found = kind(path)
    if found == "file":
        averages = read(path, mmap=True).get("ema")
    elif found == "dcp":
        averages = dcp.read(path, select=lambda k: k.startswith("ema.")).get("ema")
        averages = averages or read(path / METADATA).get("ema")  # a converted DeepSpeed checkpoint's
    else:
        averages = read(path / METADATA).get("ema") if (path / METADATA).is_file() else None
        files = sorted(path.glob("ema_partitions.rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        if averages is None and files:
            ranks = [torch.load(f, weights_only=True) for f in files]
            averages = {}
            for name, shape in ranks[0]["shapes"].items():
                flat = torch.cat([r["parts"][name].reshape(-1) for r in ranks])
                averages[name] = flat[: torch.Size(shape).numel()].reshape(shape).clone()
    if not averages:
        raise InputError(f"{path} holds no EMA weights; train with ema.decay set (e.g. ema.decay=0.999)")
    return averages


def initial_weights(path: str | Path, model: Transformer, tokenizer_json: str) -> dict[str, torch.Tensor]:
    """The weights of checkpoint ``path`` (``init.checkpoint``) for a new run's ``model``; ``ValueError`` in one line
    when they do not fit it (a weight missing, extra or of another shape: the model fields that differ are named)
    or were trained with another tokenizer (ids would mean other tokens)."""
    from dataclasses import asdict

    if not Path(path).exists():
        raise FileNotFoundError(
            f"init.checkpoint={path}: no such checkpoint (a .ckpt file or sharded directory)"
        )
    try:
        saved, info, _ = load_model(path)
    except InputError as err:  # a finetune's checkpoint, a foreign file: named by the key that gave it
        raise InputError(f"init.checkpoint: {err}") from None
    ours = model.state_dict()
    theirs = saved.state_dict()
    misfit = sorted(k for k in ours.keys() | theirs.keys() if k not in ours or k not in theirs)
    misfit += sorted(k for k in ours.keys() & theirs.keys() if ours[k].shape != theirs[k].shape)
    if misfit:
        a, b = ModelConfig.identity(info["config"]["model"]), ModelConfig.identity(asdict(model.config))
        fields = ", ".join(f"model.{k}: checkpoint {a[k]!r} vs config {b[k]!r}" for k in a if a[k] != b[k])
        raise InputError(
            f"init.checkpoint={path} holds weights of another model ({fields or misfit[:3]}); set the model "
            "fields to the checkpoint's"
        )
    if info.get("tokenizer_json") not in (None, tokenizer_json):
        raise InputError(
            f"init.checkpoint={path} was trained with another tokenizer than tokenizer.path; use its tokenizer"
        )
    return theirs


def refuse_finetuned(path: str | Path, info: dict[str, Any]) -> None:
    """``InputError`` when payload ``info`` is a `pretrain finetune` checkpoint's (a task model: ``backbone.*`` and
    head weights) given where a `pretrain fit` checkpoint is read: it ended in a traceback of missing keys
    (generate, evaluate, init.checkpoint) or a resume refusal about tokenizers (validate)."""
    if "finetune" not in info:
        return
    backbone = (info["finetune"].get("init") or {}).get("checkpoint")
    raise InputError(
        f"{path} is a `pretrain finetune` checkpoint (a task model: its backbone and head); this reads a "
        "`pretrain fit` checkpoint"
        + (f", such as the backbone it was finetuned from ({backbone})" if backbone else "")
        + f"; `pretrain export {path} DIR` writes the task model for transformers"
    )


@dataclass
class MappedWeights:
    """A `pretrain fit` checkpoint's backbone, its weights not read: ``state`` (the model's state dict; a file's
    tensors memory-mapped, ``mapped`` their keys), the model ``config``, ``info`` (the payload) and ``tokenizer``."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    mapped: set[str]
    info: dict[str, Any]
    tokenizer: Tokenizer | None

    def load(self, key: str) -> torch.Tensor:
        """Tensor ``key`` in memory of its own, a mapped one's file pages released as it is copied
        (``stream.released_copy``)."""
        tensor = self.state[key]
        return released_copy(tensor) if key in self.mapped else tensor


def mapped_weights(path: str | Path, *, ema: bool = False) -> MappedWeights:
    """The backbone of a checkpoint file or sharded checkpoint directory (consolidated into a temporary file,
    mapped), checked against its model config as ``load_state_dict`` checks it; with ``ema``, the checkpoint's
    moving average in place of every parameter (a tied one under each of its names; buffers as trained)."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        single = consolidate(path, Path(tmp) / "consolidated.ckpt") if path.is_dir() else path
        checkpoint = read(single, mmap=True)  # the optimizer state is never read into memory
    if PAYLOAD not in checkpoint:
        raise InputError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
    info = checkpoint[PAYLOAD]
    refuse_finetuned(path, info)
    config = ModelConfig(**info["config"]["model"])
    state = model_state(checkpoint)
    with torch.device("meta"):
        skeleton = Transformer(config)
    parameters = dict(skeleton.named_parameters(remove_duplicate=False))
    aliases = {
        n: [m for m, q in parameters.items() if q is p] for n, p in parameters.items()
    }  # tied: 2 names
    skeleton.load_state_dict(state, strict=True, assign=True)  # keys and shapes, as load_model checked them
    mapped = set(state)
    if ema:
        averages = model_state({"state_dict": ema_weights(path)})
        for name, average in averages.items():
            for alias in aliases[name]:
                state[alias] = average
                if kind(path) != "file":  # a file's averages are mapped; the others read into memory
                    mapped.discard(alias)
    tokenizer = Tokenizer.from_str(info["tokenizer_json"]) if info.get("tokenizer_json") else None
    return MappedWeights(config, state, mapped, info, tokenizer)


def load_model(
    path: str | Path, *, ema: bool = False
) -> tuple[Transformer, dict[str, Any], Tokenizer | None]:
    """``(model in eval mode, payload, tokenizer)`` from a checkpoint file or a sharded checkpoint directory; with
    ``ema``, the weights are the checkpoint's moving average."""
    weights = mapped_weights(path, ema=ema)
    model = Transformer(weights.config)
    model.load_state_dict(weights.state)
    return model.eval(), weights.info, weights.tokenizer
