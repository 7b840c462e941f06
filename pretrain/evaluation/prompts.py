r"""k-shot prompts, in lm-evaluation-harness's plain-text format.

A prompt is ``description + shot_1 + ... + shot_k + query`` where each shot is
``query_i + target_delimiter + answer_i + fewshot_delimiter`` (defaults ``" "`` and ``"\n\n"``), and
the scored continuation is ``target_delimiter + answer``. Per task type:

- multiple_choice: query = ``query``, answer = ``choices[gold]``; one request per choice.
- schema: query = ``context_options[gold]`` in shots, each ``context_options[i]`` for the evaluated
  example; answer = ``continuation`` (scored after every context option).
- language_modeling / generation: query = ``context``, answer = ``continuation`` / ``answer``.

Shots come from ``FewShotSampler``, which reproduces lm-evaluation-harness's ``ContextSampler``: one
``random.Random(seed)`` consumed in document order; from a pool that contains the evaluated example it
draws ``k + 1`` and drops the evaluated one, so shots never include the example being evaluated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pretrain.errors import InputError

from .tasks import Example, TaskConfig

DEFAULT_FEWSHOT_SEED = 1234  # lm-evaluation-harness's default fewshot_random_seed


class FewShotSampler:
    """Seeded shot sampler; ``exclude`` is removed by equality (as lm-eval does), never returned."""

    def __init__(self, pool: Sequence[Example], seed: int = DEFAULT_FEWSHOT_SEED) -> None:
        self.pool = list(pool)
        self.rnd = random.Random(seed)

    def sample(self, k: int, exclude: Example | None = None) -> list[Example]:
        if k == 0:
            return []
        if exclude is None:
            self._check(k, len(self.pool))
            return self.rnd.sample(self.pool, k)
        self._check(k + 1, len(self.pool))
        shots = [ex for ex in self.rnd.sample(self.pool, k + 1) if ex != exclude][:k]
        if len(shots) < k:  # the pool holds copies of the evaluated example: draw again without them
            others = [ex for ex in self.pool if ex != exclude]
            self._check(k, len(others))
            shots = self.rnd.sample(others, k)
        return shots

    @staticmethod
    def _check(needed: int, size: int) -> None:
        if needed > size:
            raise InputError(
                f"cannot draw {needed} examples from a few-shot pool of {size} (the evaluated example is "
                "drawn too, then dropped); lower num_fewshot or give a larger fewshot_path"
            )


def query_and_answer(task: TaskConfig, example: Example) -> tuple[str, str]:
    """(query, answer) of a solved example, as it appears in a shot."""
    if task.type == "multiple_choice":
        return example["query"], example["choices"][example["gold"]]
    if task.type == "schema":
        return example["context_options"][example["gold"]], example["continuation"]
    if task.type == "language_modeling":
        return example["context"], example["continuation"]
    if task.type == "generation":
        answer = example["answer"]
        return example["context"], answer if isinstance(answer, str) else answer[0]
    raise ValueError(f"task type {task.type!r} has no prompts")


def fewshot_prefix(task: TaskConfig, shots: Sequence[Example]) -> str:
    """``description`` followed by the rendered shots."""
    parts = [task.description]
    for shot in shots:
        query, answer = query_and_answer(task, shot)
        parts.append(query + task.target_delimiter + answer + task.fewshot_delimiter)
    return "".join(parts)


@dataclass
class Request:
    """What one example asks of the model.

    ``pairs``: (context, continuation) log-likelihood requests (one per choice / context option);
    ``context`` alone for generation tasks.
    """

    example: Example
    pairs: list[tuple[str, str]]
    context: str | None = None


def build_requests(
    task: TaskConfig,
    examples: Sequence[Example],
    pool: Sequence[Example] | None = None,
    seed: int = DEFAULT_FEWSHOT_SEED,
    *,
    exclude_evaluated: bool | None = None,
) -> list[Request]:
    """Prompts for ``examples`` (in order) with ``task.num_fewshot`` shots drawn from ``pool``.

    ``pool=None`` draws from ``examples``. ``exclude_evaluated`` (default: whether the pool is the evaluated
    data) drops the evaluated example from its draws, as lm-eval does when the few-shot split is the
    evaluated split; a separate pool (``fewshot_path``) is sampled without exclusion, as in lm-eval.
    """
    if exclude_evaluated is None:
        exclude_evaluated = pool is None
    sampler = FewShotSampler(examples if pool is None else pool, seed)
    requests = []
    for example in examples:
        shots = sampler.sample(task.num_fewshot, exclude=example if exclude_evaluated else None)
        prefix = fewshot_prefix(task, shots)
        delim = task.target_delimiter
        if task.type == "multiple_choice":
            ctx = prefix + example["query"]
            requests.append(Request(example, [(ctx, delim + c) for c in example["choices"]]))
        elif task.type == "schema":
            cont = delim + example["continuation"]
            requests.append(Request(example, [(prefix + opt, cont) for opt in example["context_options"]]))
        elif task.type == "language_modeling":
            requests.append(
                Request(example, [(prefix + example["context"], delim + example["continuation"])])
            )
        elif task.type == "generation":
            requests.append(Request(example, [], context=prefix + example["context"]))
        else:
            raise ValueError(f"task type {task.type!r} has no prompts (use pretrain.evaluation.perplexity)")
    return requests
