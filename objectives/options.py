"""The options each objective accepts, with their types and defaults, without importing torch: every verb checks
``objective.options`` before it imports its libraries (a bad option is one line within a second, as any other
config error). The keyword arguments of each objective's ``__init__`` past the tokenizer, in order;
``tests/unit/test_objectives_base.py`` asserts they stay equal to the classes' signatures and type hints (``Any``
where the hint names an array type: the objective checks it itself)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from pretrain.errors import InputError

REQUIRED = inspect.Parameter.empty
_SPECIAL_TOKENS = {"special_tokens": (Mapping[str, str] | None, None)}

# objective name -> option -> (type, default; REQUIRED when it has none)
OPTIONS: dict[str, dict[str, tuple[Any, Any]]] = {
    "clm": {**_SPECIAL_TOKENS},
    "mlm": {
        "mlm_probability": (float, 0.15),
        "mask_replace_prob": (float, 0.8),
        "random_replace_prob": (float, 0.1),
        "whole_word_mask": (bool, False),
        "span_masking": (bool, False),
        "span_p": (float, 0.2),
        "max_span_length": (int, 10),
        **_SPECIAL_TOKENS,
    },
    "span_corruption": {
        "noise_density": (float, 0.15),
        "mean_noise_span_length": (float, 3.0),
        **_SPECIAL_TOKENS,
    },
    "prefix_lm": {"arch": (str, "decoder"), **_SPECIAL_TOKENS},
    "ul2": {
        "input_length": (int, REQUIRED),
        "target_length": (int | None, None),
        "denoisers": (Sequence[Mapping] | None, None),
        **_SPECIAL_TOKENS,
    },
    "sgns": {
        "counts": (Any, REQUIRED),  # a sequence, NumPy array or tensor of token counts
        "window": (int, 5),
        "negatives": (int, 5),
        "subsample": (float, 1e-3),
        "min_count": (int, 5),
        "cbow": (bool, False),
        "full_softmax": (bool, False),
        "noise_power": (float, 0.75),
        **_SPECIAL_TOKENS,
    },
}


def options(name: str) -> dict[str, object]:
    """The options objective ``name`` accepts, with their defaults (``inspect.Parameter.empty`` = required)."""
    if name not in OPTIONS:
        raise InputError(f"unknown objective {name!r}; valid objectives: {sorted(OPTIONS)}")
    return {option: default for option, (_, default) in OPTIONS[name].items()}


def option_types(name: str) -> dict[str, Any]:
    """The type of each option of objective ``name`` (``Any``: checked by the objective)."""
    options(name)
    return {option: tp for option, (tp, _) in OPTIONS[name].items()}


def check_options(name: str, kwargs: Mapping[str, object]) -> None:
    """``InputError`` naming the valid names / options when ``name`` or one of ``kwargs`` is wrong or a required
    option is missing."""
    valid = options(name)
    unknown = sorted(set(kwargs) - set(valid))
    missing = sorted(k for k, default in valid.items() if default is REQUIRED and k not in kwargs)
    if unknown or missing:
        problem = f"unknown options {unknown}" if unknown else f"missing required options {missing}"
        raise InputError(f"objective {name!r}: {problem}; valid options: {sorted(valid)}")
