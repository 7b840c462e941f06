"""Pretraining transformer language models with PyTorch Lightning (see README.md).

One namespace: the repository's top-level ``objectives/`` and ``datamodules/`` folders are ``pretrain.objectives`` and
``pretrain.datamodules``. The wheel installs them there (setup.py's ``package_dir``); in a source checkout this
package's search path also covers the checkout's root, so the same imports resolve to those folders.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "objectives").is_dir() and (_checkout / "setup.py").is_file():
    __path__.append(str(_checkout))
