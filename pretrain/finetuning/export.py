"""`pretrain export`: a checkpoint as a transformers model directory (``export_checkpoint``). A finetuning
checkpoint (``finetuned.pt``, or a run's ``last.ckpt`` file or sharded directory, LoRA merged): a text-to-text model as its transformers encoder-decoder, a sequence head as the
transformers sequence classifier computing the same logits (``pretrain.models.hf.classifier_to_hf``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pretrain.errors import InputError


def is_finetuned(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint read with ``pretrain.checkpoint.read`` was written by `pretrain finetune`."""
    from pretrain.checkpoint import PAYLOAD

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


def _check_export_target(out_dir: Path, force: bool, verb: str = "export") -> None:
    """An export goes into a new or empty directory (``--force``: overwrite the files it writes there). ``verb``:
    the command that asked (``convert --to hf`` has no ``--force``: its line names ``export``'s)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file; {verb} into a directory (it is created if missing)")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        overwrite = (
            "pass --force" if verb == "export" else f"use `pretrain export --force CHECKPOINT {out_dir}`"
        )
        raise InputError(
            f"{out_dir} is not empty; {verb} into a new or empty directory, or {overwrite} to overwrite "
            f"the files the export writes there"
        )
    out_dir.mkdir(parents=True, exist_ok=True)  # PermissionError here names the directory
    with tempfile.TemporaryFile(dir=out_dir):  # and here, when it exists but may not be written
        pass


def export_checkpoint(
    path: Path, out_dir: str | Path, force: bool = False, ema: bool = False, verb: str = "export"
) -> Path:
    """Checkpoint ``path`` (any layout; ``pretrain finetune``'s included) as a transformers model directory
    ``out_dir``, new or empty (``force``: overwrite the files written there); ``ema``: the weights' moving average.
    Under ``out_dir``'s lock; a failed export leaves no directory it created."""
    import warnings

    from pretrain.io import remove_stale_staging, run_lock

    created = not Path(out_dir).exists()
    with run_lock(out_dir, "`pretrain export`"):
        stale = remove_stale_staging(out_dir)  # exports killed mid-write
        if stale:
            warnings.warn(
                f"removed {len(stale)} staging director{'y' if len(stale) == 1 else 'ies'} of an interrupted "
                f"export to {out_dir} ({', '.join(p.name for p in stale)})",
                stacklevel=2,
            )
        try:
            return _export(path, out_dir, force, ema, verb)
        except BaseException:
            if created and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):  # no trace
                Path(out_dir).rmdir()
            raise


def _export(path: Path, out_dir: str | Path, force: bool, ema: bool, verb: str) -> Path:
    _check_export_target(Path(out_dir), force, verb)  # under the lock, before the heavy imports
    from pretrain.checkpoint import consolidate, read
    from pretrain.checkpoint.convert import mapped_weights
    from pretrain.models.hf import save_hf_streamed

    with tempfile.TemporaryDirectory() as tmp:
        single = consolidate(path, Path(tmp) / "consolidated.ckpt")  # a file is returned as it is
        if is_finetuned(read(single, mmap=True)) and not ema:  # `pretrain finetune`: LoRA merged
            out = export_finetuned(single, out_dir)
        else:  # tensor by tensor, from the mapped file
            weights = mapped_weights(path, ema=True) if ema else mapped_weights(single)
            special_tokens = weights.info.get("config", {}).get("tokenizer", {}).get("special_tokens")
            out = save_hf_streamed(weights.config, weights.load, out_dir, weights.tokenizer, special_tokens)
    return out
