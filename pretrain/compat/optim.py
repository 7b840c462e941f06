"""torch.optim's private flag for fused kernels, in one place (tested with torch 2.13.0).

- ``honours_found_inf``: ``Optimizer._step_supports_amp_scaling``, set by the optimizers whose ``step`` takes
  ``GradScaler``'s ``found_inf`` tensor (the fused Adam/AdamW/SGD kernels read it on the device); torch has no
  public way to ask.
"""

from __future__ import annotations

import torch


def honours_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class declares that its ``step`` can take a ``found_inf`` tensor (``fused=True``
    must still be set for it to be read)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
