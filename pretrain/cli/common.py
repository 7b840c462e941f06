"""What several verbs take: a recipe with ``key=value`` overrides, a checkpoint that must exist."""

from __future__ import annotations

import argparse
from pathlib import Path


def recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. trainer.max_steps=100")


def existing_checkpoint(path: str, where: str) -> Path:
    """``path``, which a verb reads (``where``: its flag or argument), or the one line saying it does not exist."""
    if not Path(path).exists():
        raise FileNotFoundError(f"checkpoint {path} ({where}) does not exist")
    return Path(path)
