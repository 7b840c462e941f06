"""One installed namespace: the repository's ``configs/`` and ``recipes/`` folders install as ``pretrain.configs``
and ``pretrain.recipes`` (package data), never as top-level packages that would collide with another project's.
pyproject.toml holds everything else; setuptools' ``package-dir`` needs the packages listed, hence this file."""

from setuptools import find_namespace_packages, setup

SHIPPED = {"pretrain.configs": "configs", "pretrain.recipes": "recipes"}

setup(
    packages=[
        *find_namespace_packages(include=["pretrain", "pretrain.*", "objectives*", "datamodules*"]),
        *SHIPPED,
    ],
    package_dir=SHIPPED,
)
