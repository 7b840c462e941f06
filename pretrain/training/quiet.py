"""Library noise off by default (``--debug`` / ``PRETRAIN_DEBUG=1`` shows it): Lightning's advertising tips and
the deprecation notices libraries raise about their own internals. Our own warnings are kept."""

from __future__ import annotations

import logging
import os
import warnings

LIBRARIES = (
    r"(lightning|lightning_fabric|pytorch_lightning|torch|transformers|deepspeed|wandb|torchmetrics)(\.|$)"
)
ADVERTISING = ("💡 Tip:",)


class _DropAdvertising(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISING)


def quiet_libraries() -> None:
    """Ignore library deprecation warnings and drop Lightning's tips (idempotent)."""
    if os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0"):
        return
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
    warnings.filterwarnings("ignore", message=r".*\bis deprecated\b", module=LIBRARIES)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertising) for f in logger.filters):
            logger.addFilter(_DropAdvertising())
