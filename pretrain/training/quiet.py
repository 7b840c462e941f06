"""Library noise off by default on every verb (``--debug`` / ``PRETRAIN_DEBUG=1`` shows it): Lightning's
advertising tips, the deprecation notices libraries raise about their own internals, the notices they log about
themselves on import (torchao's optional kernels that do not load on this machine, torch's pytree registry
deprecations that torchao triggers, DeepSpeed settling on the CPU where no accelerator is found), and two notices
tensor parallelism raises on every run though nothing is wrong: FSDP2's that a module returned a view (DTensor's
``to_local`` returns views, which nothing modifies in place) and DTensor's that a reduction over two mesh dims
takes two collectives (the gradient norm's scalar all-reduces, in the same order on every rank), and Lightning's
"Checkpoint directory ... exists and is not empty" (a resume's directory is its checkpoints'). Our own warnings
are kept, each on one line (``warning: ...``, not Python's ``/path/file.py:427: UserWarning: ...`` followed by the
source line that raised it)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

LIBRARIES = (
    r"(lightning|lightning_fabric|pytorch_lightning|torch|transformers|deepspeed|wandb|torchmetrics)(\.|$)"
)
# logger name -> the start of the messages dropped (a library's notices about itself, not about the run)
NOTICES = {
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip:",),
    "torchao": ("Failed to load ",),  # its optional CUDA / CUTLASS extensions
    "torch.utils._pytree": (
        "<enum ",
    ),  # "... is an Enum subclass ...: register_constant() ... is deprecated"
    "DeepSpeed": ("Setting accelerator to CPU",),
    "torch.distributed.tensor._redistribute": ("While redistributing from",),  # two collectives, in order
}


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # pretrain/
_OTHERS_FORMAT = [warnings.formatwarning]  # the format ours wraps (Lightning's, where it was imported first)
_FORMATTING = threading.local()


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Our warnings as ``warning: <message>``: what they say is the whole message, not where it was raised.
    Others' in the format ours wraps; when that format wraps ours in turn (Lightning's, imported after a first
    ``quiet_libraries`` and wrapped by a second: each calls the other), Python's layout without the source line."""
    if str(filename).startswith(_PACKAGE):
        return f"warning: {message}\n"
    if getattr(_FORMATTING, "active", False):
        return f"{filename}:{lineno}: {category.__name__}: {message}\n"
    _FORMATTING.active = True
    try:
        return _OTHERS_FORMAT[0](message, category, filename, lineno, line)
    finally:
        _FORMATTING.active = False


class _DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


def quiet_libraries() -> None:
    """Ignore library deprecation warnings and drop the notices of ``NOTICES`` (idempotent; set before the
    libraries are imported, the filters hold when they log at import)."""
    if os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0"):
        return
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
    warnings.filterwarnings("ignore", message=r".*\bis deprecated\b", module=LIBRARIES)
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", module=LIBRARIES
    )
    warnings.filterwarnings(
        "ignore", message=r"Checkpoint directory .* exists and is not empty", module=LIBRARIES
    )
    if warnings.formatwarning is not _format_warning:
        _OTHERS_FORMAT[0], warnings.formatwarning = warnings.formatwarning, _format_warning
    for name, starts in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(starts))


@contextlib.contextmanager
def data_position_restored() -> Iterator[None]:
    """Around ``trainer.fit`` of a datamodule whose own state restores the data position exactly
    (``PretrainData``, ``FinetuneDataModule``): Lightning looks for a stateful DataLoader only, so its warning on
    every mid-epoch resume ("your dataloader is not resumable ... unreliable results") is untrue there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch")
        yield
