"""A baseline run: compose the recipe, train and evaluate its kind, write ``<run_dir>/results.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pretrain.baselines.config import load_config
from pretrain.baselines.lstm_lm import run_rnn_lm
from pretrain.baselines.seq2seq import run_seq2seq
from pretrain.baselines.word_vectors import run_glove, run_sgns

RUNS = {"sgns": run_sgns, "glove": run_glove, "rnn_lm": run_rnn_lm, "seq2seq": run_seq2seq}


def run_recipe(recipe: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate a baseline recipe; returns (and writes to ``<run_dir>/results.json``) its results."""
    import lightning as L

    run, baseline, resolved = load_config(recipe, overrides)
    L.seed_everything(
        run.seed, verbose=False
    )  # before the baseline builds its model: the seed fixes the init
    results = {"name": run.name, "kind": baseline.kind, **RUNS[baseline.kind](run, baseline, resolved)}
    path = Path(run.run_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_json_default))
    return results


def _json_default(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)
