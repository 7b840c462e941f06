"""Checkpoints: ``io`` (atomic writes, weights-only reads, layouts), ``optimizer_state`` (its two layouts),
``stream`` (conversion tensor by tensor), ``convert`` (sharded -> one file, loading for inference), ``reshard``
(any layout restored under any strategy), ``resume`` (``resume=auto`` discovery and what may resume what) and
``lightning_io`` (Lightning's ``CheckpointIO`` plugin: atomic writes). Nothing here but ``lightning_io`` (and
what its callers import lazily) imports Lightning.

A checkpoint is Lightning's (weights, optimizer, scheduler, loop progress, callbacks, datamodule position) plus
``checkpoint["pretrain"]``: the resolved run config, the tokenizer (``tokenizer.json`` text), the W&B run id and
the tokens seen. Dropout randomness is a function of (seed, optimizer step, micro-batch, rank) -- see
``PretrainModule`` -- so restoring the step restores the random state exactly. Files are loaded with
``torch.load(weights_only=True)``: no code from a checkpoint ever runs.
"""

from pretrain.checkpoint.convert import consolidate, load_model
from pretrain.checkpoint.io import PAYLOAD, CheckpointWriteError, kind, payload, read
from pretrain.checkpoint.resume import check_compatible, check_resumable, find_resume, is_valid

__all__ = [
    "PAYLOAD",
    "CheckpointWriteError",
    "check_compatible",
    "check_resumable",
    "consolidate",
    "find_resume",
    "is_valid",
    "kind",
    "load_model",
    "payload",
    "read",
]
