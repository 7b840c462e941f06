"""Pretraining transformer language models with PyTorch Lightning (see README.md).

One namespace: the repository's top-level ``objectives/`` and ``datamodules/`` folders are ``pretrain.objectives``
and ``pretrain.datamodules`` through the committed relative symlinks ``pretrain/objectives -> ../objectives`` and
``pretrain/datamodules -> ../datamodules``: a checkout, an editable install and the wheel (setuptools follows
them) resolve the same files, and so do static tools (mypy, pyright, jedi).
"""
