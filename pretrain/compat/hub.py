"""Hugging Face ``datasets``' private fingerprint, in one place (tested with datasets 5.2.0).

- ``fingerprint``: ``Dataset._fingerprint``, the hash ``datasets`` keeps of a dataset's content and the
  transforms applied to it (its cache key); there is no public accessor.
"""

from __future__ import annotations

from typing import Any


def fingerprint(dataset: Any) -> str:
    """The content fingerprint ``datasets`` computed for ``dataset`` (a ``datasets.Dataset``)."""
    return str(dataset._fingerprint)
