"""A baseline run: compose the recipe, train and evaluate its kind, write ``<run_dir>/results.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.baselines.config import load_config
from pretrain.baselines.lstm_lm import run_rnn_lm
from pretrain.baselines.seq2seq import run_seq2seq
from pretrain.baselines.word_vectors import run_glove, run_sgns
from pretrain.errors import InputError
from pretrain.io import atomic_write_text

RUNS: dict[str, Callable[[Any, Any, dict[str, Any]], dict[str, Any]]] = {
    "sgns": run_sgns,
    "glove": run_glove,
    "rnn_lm": run_rnn_lm,
    "seq2seq": run_seq2seq,
}
# baselines that read the token stream across document boundaries (a recurrent state, context windows)
STREAM_KINDS = {
    "sgns": "its context windows",
    "glove": "its co-occurrence windows",
    "rnn_lm": "a recurrent LM's state",
}


def check_document_mask(run: Any, kind: str) -> None:
    """``InputError`` when ``data.document_mask`` asks a baseline to keep documents apart that it cannot."""
    if run.data.document_mask and kind in STREAM_KINDS:
        raise InputError(
            f"baseline {kind} cannot honour data.document_mask: {STREAM_KINDS[kind]} run across document "
            "boundaries; set data.document_mask=false"
        )


def run_recipe(recipe: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate a baseline recipe; returns (and writes to ``<run_dir>/results.json``) its results."""
    from pretrain.io import run_lock

    run, baseline, resolved = load_config(recipe, overrides)
    check_document_mask(run, baseline.kind)
    with run_lock(run.run_path, "`pretrain baseline`"):  # one writer of the run's checkpoints and results
        return _run(run, baseline, resolved)


def _run(run: Any, baseline: Any, resolved: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    L.seed_everything(
        run.seed, verbose=False
    )  # before the baseline builds its model: the seed fixes the init
    results = {"name": run.name, "kind": baseline.kind, **RUNS[baseline.kind](run, baseline, resolved)}
    path = run.run_path / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2, default=_json_default))
    return results


def _json_default(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)
