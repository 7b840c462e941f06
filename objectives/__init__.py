"""Pretraining objectives: pure, seeded functions of a packed batch of token ids (see ``pretrain.objectives.base``).

``build(name, tokenizer, **options)`` returns one by name: ``clm`` (GPT), ``mlm`` (BERT/RoBERTa),
``span_corruption`` (T5), ``prefix_lm``, ``ul2`` (UL2 mixture of denoisers), ``sgns`` (word2vec skip-gram /
CBOW with negative sampling). GloVe (``pretrain.objectives.glove.GloVe``) fits a co-occurrence matrix, not token batches,
so it is not built by name. Their options are checked without torch (``pretrain.objectives.options``); the
objectives themselves are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pretrain.objectives.options import check_options, options

if TYPE_CHECKING:
    from pretrain.objectives.base import Objective
    from pretrain.objectives.clm import CausalLM
    from pretrain.objectives.glove import GloVe
    from pretrain.objectives.loss import IGNORE_INDEX, token_cross_entropy
    from pretrain.objectives.mlm import MaskedLM
    from pretrain.objectives.prefix_lm import PrefixLM
    from pretrain.objectives.sgns import SkipGram
    from pretrain.objectives.span_corruption import SpanCorruption
    from pretrain.objectives.ul2 import UL2

# name -> module: imported on first use, so that a config check needs no torch
_EXPORTS = {
    "IGNORE_INDEX": "loss",
    "token_cross_entropy": "loss",
    "Objective": "base",
    "CausalLM": "clm",
    "GloVe": "glove",
    "MaskedLM": "mlm",
    "PrefixLM": "prefix_lm",
    "SkipGram": "sgns",
    "SpanCorruption": "span_corruption",
    "UL2": "ul2",
}
_BY_NAME = ("CausalLM", "MaskedLM", "SpanCorruption", "PrefixLM", "UL2", "SkipGram")


def __getattr__(name: str) -> Any:
    if name == "OBJECTIVES":  # objective name -> class
        value: Any = {cls.name: cls for cls in (__getattr__(n) for n in _BY_NAME)}
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def build(name: str, tokenizer, **kwargs) -> Objective:
    """Objective ``name`` for ``tokenizer``, its options checked (``check_options``)."""
    check_options(name, kwargs)
    return __getattr__("OBJECTIVES")[name](tokenizer, **kwargs)


__all__ = [
    "IGNORE_INDEX",
    "OBJECTIVES",
    "UL2",
    "CausalLM",
    "GloVe",
    "MaskedLM",
    "Objective",
    "PrefixLM",
    "SkipGram",
    "SpanCorruption",
    "build",
    "check_options",
    "options",
    "token_cross_entropy",
]
