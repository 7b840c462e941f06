"""One installed namespace: the repository's top-level ``objectives/``, ``datamodules/``, ``configs/`` and
``recipes/`` folders install as ``pretrain.objectives``, ``pretrain.datamodules``, ``pretrain.configs`` and
``pretrain.recipes``, never as top-level packages that would collide with another project's. pyproject.toml holds
everything else; setuptools' ``package-dir`` needs the packages listed, hence this file. (In a source checkout
``pretrain/__init__.py`` maps the same folders.)"""

from setuptools import find_namespace_packages, setup

MAPPED = {"pretrain.objectives": "objectives", "pretrain.datamodules": "datamodules"}
SHIPPED = {"pretrain.configs": "configs", "pretrain.recipes": "recipes"}

setup(
    packages=[
        *find_namespace_packages(include=["pretrain", "pretrain.*"]),
        *MAPPED,
        *SHIPPED,
    ],
    package_dir={**MAPPED, **SHIPPED},
)
