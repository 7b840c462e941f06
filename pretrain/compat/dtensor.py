"""DTensor's private local shard, in one place (tested with torch 2.13.0).

- ``local_shard``: ``DTensor._local_tensor``, the shard a rank holds, read without ``to_local()`` (which is an
  autograd op: under a fake mode and on a parameter it would record a view); a plain tensor is its own shard.
"""

from __future__ import annotations

from torch import Tensor


def local_shard(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, else ``tensor`` itself."""
    local: Tensor = getattr(tensor, "_local_tensor", tensor)
    return local
