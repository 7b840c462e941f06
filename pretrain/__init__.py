"""Pretraining transformer language models with PyTorch Lightning (see README.md).

One namespace: the repository's top-level ``objectives/`` and ``datamodules/`` folders are ``pretrain.objectives`` and
``pretrain.datamodules``. The wheel installs them there (setup.py's ``package_dir``); in a source checkout a finder
for exactly those two names resolves the same imports to the checkout's folders.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
_MAPPED = {f"pretrain.{name}": _checkout / name for name in ("objectives", "datamodules")}


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """``pretrain.objectives`` / ``pretrain.datamodules`` from the checkout's top-level folders (their submodules
    then resolve through the package's ``__path__`` as usual)."""

    def find_spec(self, name, path=None, target=None):
        folder = _MAPPED.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if not (_Path(__file__).parent / "objectives").is_dir() and all(
    (folder / "__init__.py").is_file() for folder in _MAPPED.values()
):
    sys.meta_path.append(_CheckoutFolders())
