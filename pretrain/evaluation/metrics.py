"""Per-example metrics and their aggregation, as lm-evaluation-harness defines them.

- ``acc``: ``argmax_i ll_i == gold`` (multiple choice, schema) or ``is_greedy`` (language modeling);
- ``acc_norm``: ``argmax_i ll_i / len(choice_i) == gold`` with the length in *characters* of the choice
  (without the target delimiter);
- ``perplexity`` (language modeling): ``exp(-mean_i ll_i)`` over examples;
- ``exact_match``: prediction (optionally stripped / case-folded) equals any reference;
- rolling perplexity: ``word_perplexity = exp(-sum ll / sum words)``, ``byte_perplexity =
  exp(-sum ll / sum bytes)``, ``bits_per_byte = -sum ll / sum bytes / ln 2``, and
  ``token_perplexity = exp(-sum ll / sum tokens)``.

- CORE-style aggregate (DCLM / nanochat's CORE): each accuracy task's ``acc`` centred on its chance level
  ``c`` (the mean over its examples of ``1 / number of options``; 0 for language modeling) and rescaled,
  ``(acc - c) / (1 - c)``, then averaged over tasks: 0 is chance, 1 is perfect.

The standard error of a mean metric is the sample standard deviation (ddof=1) over ``sqrt(n)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def multiple_choice_metrics(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    lls_arr = np.asarray(lls, dtype=np.float64)
    lengths = np.asarray([float(len(c)) for c in choices])
    return {
        "acc": float(np.argmax(lls_arr) == gold),
        "acc_norm": float(np.argmax(lls_arr / lengths) == gold),
    }


def schema_metrics(lls: Sequence[float], gold: int) -> dict[str, float]:
    return {"acc": float(np.argmax(np.asarray(lls, dtype=np.float64)) == gold)}


def exact_match(prediction: str, references: str | Sequence[str], *, strip: bool, ignore_case: bool) -> float:
    refs = [references] if isinstance(references, str) else list(references)

    def norm(s: str) -> str:
        s = s.strip() if strip else s
        return s.lower() if ignore_case else s

    return float(any(norm(prediction) == norm(r) for r in refs))


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values))


def mean_stderr(values: Sequence[float]) -> float | None:
    """Sample standard deviation / sqrt(n) (lm-eval's ``mean_stderr``); None for a single value."""
    if len(values) < 2:
        return None
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def perplexity(lls: Sequence[float]) -> float:
    """``exp(-mean ll)`` over examples (lm-eval's ``perplexity`` aggregation, e.g. LAMBADA)."""
    return math.exp(-mean(lls))


def rolling_metrics(
    lls: Sequence[float], words: Sequence[int], nbytes: Sequence[int], tokens: Sequence[int]
) -> dict[str, float]:
    total = float(sum(lls))
    return {
        "word_perplexity": math.exp(-total / sum(words)),
        "byte_perplexity": math.exp(-total / sum(nbytes)),
        "bits_per_byte": -total / sum(nbytes) / math.log(2),
        "token_perplexity": math.exp(-total / sum(tokens)),
    }


def centered_accuracy(acc: float, chance: float) -> float:
    """``(acc - chance) / (1 - chance)``: 0 at chance level, 1 when every example is right."""
    return (acc - chance) / (1 - chance)


def core_score(accuracies: Sequence[tuple[float, float]]) -> float:
    """Mean centred accuracy over (acc, chance) pairs, one per task."""
    return mean([centered_accuracy(acc, chance) for acc, chance in accuracies])
