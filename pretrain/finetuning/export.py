"""`pretrain export` of a finetuning checkpoint (``finetuned.pt``, or a run's ``last.ckpt`` file or sharded
directory, LoRA merged): a text-to-text model as its transformers encoder-decoder, a sequence head as the
transformers sequence classifier computing the same logits (``pretrain.models.hf.classifier_to_hf``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def is_finetuned(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint read with ``pretrain.training.checkpoint.read`` was written by `pretrain finetune`."""
    from pretrain.training.checkpoint import PAYLOAD

    return "finetune" in checkpoint.get(PAYLOAD, {})


def export_finetuned(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the finetuned model of a single-file ``checkpoint`` to ``out_dir`` (``pretrain.models.hf.save_hf``:
    weights, config with the tokenizer's special-token ids, tokenizer; class names as ``id2label``)."""
    from pretrain.finetuning.checkpoint import load_finetuned, save_finetuned
    from pretrain.models.hf import save_hf

    with tempfile.TemporaryDirectory() as tmp:
        save_finetuned(Path(tmp) / "finetuned.pt", Path(checkpoint))  # LoRA merged, if not yet
        model, info, tokenizer = load_finetuned(Path(tmp) / "finetuned.pt")
    roles = info["config"]["tokenizer"]["special_tokens"]
    return save_hf(model, out_dir, tokenizer, roles, label_names=info.get("label_names"))
