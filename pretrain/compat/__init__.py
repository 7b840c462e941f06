"""Every use of a dependency's private API, one module per dependency area, and the one table of the releases
they were tested with.

- ``lightning``: Lightning's and DeepSpeed's internals (strategies, logging schedule, torchmetrics import)
- ``memory``: torch's memory-estimation internals (fake tensors, fake process group, ``MemTracker``)
- ``muon``: torch's Muon Newton-Schulz iteration
- ``optim``: torch.optim's flag for optimizers that take ``found_inf`` (fused kernels)
- ``dtensor``: a DTensor's local shard
- ``hub``: ``datasets``' fingerprint of a hub dataset
- ``omegaconf_nodes``: OmegaConf's unresolved node access
- ``compile``: torch.compile's counters and dynamic-shape marks
- ``torch_save``: ``torch.save``'s private writer and DCP's chunk layout
- ``collectives``: torch.distributed's functional all-gather and ``DeviceMesh._flatten``
- ``attention``: CPU SDPA's flash kernel and its backward (log-sum-exp in and out)
- ``hf_save``: transformers' tied-weight removal on save and safetensors' file layout (an export written
  tensor by tensor)

``warn_if_untested`` (called once when a Trainer is built) names every installed package of ``TESTED_WITH`` at
another release: the internals above may have changed there. This module imports nothing heavy.
"""

from __future__ import annotations

import warnings
from importlib import metadata

TESTED_WITH = {
    "lightning": "2.6.6",
    "deepspeed": "0.19.8",
    "torch": "2.13.0",
    "torchmetrics": "1.9.0",
    "lightning-utilities": "0.15.3",
    "datasets": "5.2.0",
    "omegaconf": "2.4.0",
    "transformers": "5.24.0",
    "safetensors": "0.8.0",
}


def untested_versions() -> dict[str, str]:
    """``{package: installed version}`` of the installed ``TESTED_WITH`` packages at another release (a local
    build tag such as ``+cpu`` aside)."""
    found = {}
    for name, tested in TESTED_WITH.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if installed.split("+")[0] != tested:
            found[name] = installed
    return found


def warn_if_untested() -> None:
    """One warning naming the packages whose private internals used here may have changed."""
    if found := untested_versions():
        listed = ", ".join(f"{n} {v} (tested: {TESTED_WITH[n]})" for n, v in sorted(found.items()))
        warnings.warn(
            f"pretrain.compat uses private internals tested with other releases: {listed}; "
            "check the items of its modules' docstrings if training misbehaves",
            stacklevel=2,
        )
