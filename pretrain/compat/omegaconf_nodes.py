"""OmegaConf's private node access, in one place (tested with omegaconf 2.4.0).

- ``child``: ``DictConfig._get_node``, a key's node as stored (a ``ListConfig`` / ``DictConfig`` / value node),
  without resolving interpolations or converting it as ``config[key]`` does.
"""

from __future__ import annotations

from typing import Any


def child(config: Any, key: Any) -> Any:
    """The node under ``key`` of the ``DictConfig`` ``config``, unresolved."""
    return config._get_node(key)
