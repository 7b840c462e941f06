"""Perplexity and bits-per-byte of raw text with rolling windows (lm-eval's ``loglikelihood_rolling``).

A document's tokens ``t_0 .. t_{N-1}`` are predicted window by window so every token is scored exactly
once, each with as much context as fits in ``max_seq_len``:

- window 1 reads ``[prefix] + t[0 : L-1]`` and predicts ``t[0 : L]`` (``L = min(max_seq_len, N)``);
- each next window predicts the next ``max_seq_len - context_len + 1`` tokens (fewer at the end),
  reading the ``max_seq_len`` tokens that precede each predicted one;
- ``disjoint_window`` splits a window into (context, continuation) so that the context does not overlap
  the predicted tokens, turning it into an ordinary log-likelihood request.

With ``context_len=1`` (lm-eval's choice) window k predicts ``t[k*L : (k+1)*L]`` reading
``t[k*L - 1 : (k+1)*L - 1]``; only the last, shorter window reads tokens a previous window predicted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from pretrain.errors import InputError

from .metrics import rolling_metrics
from .scoring import LMScorer, Request, ScoreFn


def rolling_token_windows(
    tokens: Sequence[int], prefix_token: int, max_seq_len: int, context_len: int = 1
) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``(input_tokens, predicted_tokens)``; score the last ``len(predicted)`` outputs of each input."""
    if not 1 <= context_len <= max_seq_len:
        raise InputError(f"context_len must be in [1, max_seq_len={max_seq_len}], got {context_len}")
    tokens = list(tokens)
    if not tokens:
        return
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(tokens))
    yield [prefix_token] + tokens[: first - 1], tokens[:first]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, pred_len)
        end = done + n
        yield tokens[end - max_seq_len - 1 : end - 1], tokens[end - n : end]
        done = end


def disjoint_window(window: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """Drop from the input the tokens that are also predicted: (context, continuation)."""
    inputs, predicted = window
    return inputs[: len(inputs) - (len(predicted) - 1)], predicted


def rolling_requests(
    scorer: LMScorer, texts: Sequence[str], context_len: int = 1
) -> tuple[list[Request], list[int], list[int]]:
    """(log-likelihood requests of every window, the text each belongs to, tokens per text); windows are
    ``scorer.window_length`` long (an encoder's pseudo-log-likelihood reads [CLS] and [SEP] besides)."""
    requests, owner, counts = [], [], []
    for i, text in enumerate(texts):
        tokens = scorer.encode(text)
        counts.append(len(tokens))
        windows = rolling_token_windows(tokens, scorer.prefix_token_id, scorer.window_length, context_len)
        for window in windows:
            requests.append(disjoint_window(window))
            owner.append(i)
    return requests, owner, counts


def loglikelihood_rolling(
    scorer: LMScorer, texts: Sequence[str], context_len: int = 1, score: ScoreFn | None = None
) -> list[tuple[float, int]]:
    """(total log-likelihood, number of tokens) of each text, all windows batched together by ``score``
    (default ``scorer.loglikelihood_tokens``)."""
    requests, owner, counts = rolling_requests(scorer, texts, context_len)
    totals = [0.0] * len(texts)
    for i, (ll, _) in zip(owner, (score or scorer.loglikelihood_tokens)(requests)):
        totals[i] += ll
    return list(zip(totals, counts))


def count_words(text: str) -> int:
    """lm-eval's default word count: pieces of a split on whitespace runs."""
    return len(re.split(r"\s+", text))


def evaluate_perplexity(
    scorer: LMScorer, documents: Sequence[str], score: ScoreFn | None = None
) -> tuple[dict[str, float], list[dict]]:
    """Corpus-level word/byte/token perplexity and bits-per-byte, and per-document records (an encoder's
    are pseudo-perplexities: each token scored by its pseudo-log-likelihood within its window)."""
    scored = loglikelihood_rolling(scorer, documents, score=score)
    words = [count_words(d) for d in documents]
    nbytes = [len(d.encode("utf-8")) for d in documents]
    tokens = [n for _, n in scored]
    metrics = rolling_metrics([ll for ll, _ in scored], words, nbytes, tokens)
    records = [
        {"loglikelihood": ll, "tokens": n, "words": w, "bytes": b}
        for (ll, n), w, b in zip(scored, words, nbytes)
    ]
    return metrics, records
