"""Pretraining objectives: pure, seeded functions of a packed batch of token ids (see ``pretrain.objectives.base``).

``build(name, tokenizer, **options)`` returns one by name: ``clm`` (GPT), ``mlm`` (BERT/RoBERTa),
``span_corruption`` (T5), ``prefix_lm``, ``ul2`` (UL2 mixture of denoisers), ``sgns`` (word2vec skip-gram /
CBOW with negative sampling). GloVe (``pretrain.objectives.glove.GloVe``) fits a co-occurrence matrix, not token batches,
so it is not built by name.
"""

from __future__ import annotations

import inspect

from pretrain.errors import InputError
from pretrain.objectives.base import Objective
from pretrain.objectives.clm import CausalLM
from pretrain.objectives.glove import GloVe
from pretrain.objectives.loss import IGNORE_INDEX, token_cross_entropy
from pretrain.objectives.mlm import MaskedLM
from pretrain.objectives.prefix_lm import PrefixLM
from pretrain.objectives.sgns import SkipGram
from pretrain.objectives.span_corruption import SpanCorruption
from pretrain.objectives.ul2 import UL2

OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (CausalLM, MaskedLM, SpanCorruption, PrefixLM, UL2, SkipGram)
}


def options(name: str) -> dict[str, object]:
    """The options objective ``name`` accepts, with their defaults (``inspect.Parameter.empty`` = required)."""
    if name not in OBJECTIVES:
        raise InputError(f"unknown objective {name!r}; valid objectives: {sorted(OBJECTIVES)}")
    parameters = list(inspect.signature(OBJECTIVES[name].__init__).parameters.values())[2:]
    return {p.name: p.default for p in parameters}


def check_options(name: str, kwargs: dict[str, object]) -> None:
    """ValueError naming the valid names / options when ``name`` or one of ``kwargs`` is wrong or a required
    option is missing."""
    valid = options(name)
    unknown = sorted(set(kwargs) - set(valid))
    missing = sorted(
        k for k, default in valid.items() if default is inspect.Parameter.empty and k not in kwargs
    )
    if unknown or missing:
        problem = f"unknown options {unknown}" if unknown else f"missing required options {missing}"
        raise InputError(f"objective {name!r}: {problem}; valid options: {sorted(valid)}")


def build(name: str, tokenizer, **kwargs) -> Objective:
    """Objective ``name`` for ``tokenizer``, its options checked (``check_options``)."""
    check_options(name, kwargs)
    return OBJECTIVES[name](tokenizer, **kwargs)


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
