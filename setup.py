"""One installed namespace: the repository's top-level ``configs/`` and ``recipes/`` folders install as
``pretrain.configs`` and ``pretrain.recipes``, never as top-level packages that would collide with another
project's (``objectives/`` and ``datamodules/`` are ``pretrain.objectives`` and ``pretrain.datamodules`` through
the symlinks ``pretrain/objectives`` and ``pretrain/datamodules``, which setuptools follows into the wheel).
pyproject.toml holds everything else; setuptools' ``package-dir`` needs the packages listed, hence this file."""

from setuptools import find_namespace_packages, setup

SHIPPED = {"pretrain.configs": "configs", "pretrain.recipes": "recipes"}

setup(
    packages=[
        *find_namespace_packages(include=["pretrain", "pretrain.*"]),
        *SHIPPED,
    ],
    package_dir=SHIPPED,
)
