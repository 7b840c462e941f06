"""Every use of torch's private distributed internals by ``pretrain.parallel``, in one place (tested with torch
2.13.0).

- ``all_gather``: ``torch.distributed._functional_collectives.all_gather_single``, the all-gather torchtitan and
  DTensor use: differentiable (its backward is a reduce-scatter of the gradient, summed), any gather axis, any
  backend with ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (gloo and NCCL), traceable by
  ``torch.compile``. The public ``torch.distributed.nn.functional.all_gather`` is deprecated in its favour.
- ``flatten``: ``DeviceMesh._flatten``, two or more dims of a mesh as one (torchtitan's ``dp_shard_cp``, the dim
  FSDP2 shards over under context parallelism); torch has no public way to name such a dim yet.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def all_gather(x: Tensor, dim: int, group: Any) -> Tensor:
    """Every rank's ``x`` of ``group``, concatenated along ``dim`` in rank order (differentiable)."""
    from torch.distributed._functional_collectives import all_gather_single

    return all_gather_single(x, dim, group)


def flatten(mesh: Any, name: str) -> Any:
    """The dims of ``mesh`` (a slice of a root mesh) as one dim ``name``, which the root mesh can then be
    indexed by."""
    return mesh._flatten(name)
