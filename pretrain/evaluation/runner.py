"""Run tasks on a scorer; report results as JSON, a printed table, and W&B metrics.

``results = evaluate(scorer, tasks, seed=1234)`` returns::

    {"results": {task: {"type", "num_fewshot", "num_examples", "seed", "metrics": {m: value},
                        "stderr": {m: value | None},
                        "truncated": examples whose prompt was cut to fit the model's context,
                        "chance": chance-level acc (accuracy tasks)}},
     "core": mean centred accuracy over the accuracy tasks (metrics.core_score; absent without any),
     "samples": {task: [per-example records]}}      # with log_samples=True

Log-likelihoods are computed by ``score`` (default ``scorer.loglikelihood_tokens``): a caller may shard the
token requests over processes (``pretrain.training.callbacks.in_loop_eval``) as long as it returns them in order.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pretrain.errors import InputError
from pretrain.io import atomic_write_text

from . import metrics as M
from .config import EvalConfig, load_tasks
from .perplexity import evaluate_perplexity
from .prompts import DEFAULT_FEWSHOT_SEED, build_requests
from .scoring import LMScorer, ScoreFn
from .tasks import TaskConfig, load_documents, load_examples

OPTIONS_KEY = {"multiple_choice": "choices", "schema": "context_options"}


def _chance(task: TaskConfig, examples: Sequence[dict]) -> float | None:
    """Expected ``acc`` of a uniform guess: mean of 1 / options (0 for language modeling's greedy match)."""
    if task.type == "language_modeling":
        return 0.0
    if task.type in OPTIONS_KEY:
        return M.mean([1 / len(ex[OPTIONS_KEY[task.type]]) for ex in examples])
    return None


def _score_loglikelihood_task(
    scorer: LMScorer, task: TaskConfig, requests, score: ScoreFn
) -> tuple[dict, list[dict], int]:
    flat = scorer.encode_requests([pair for req in requests for pair in req.pairs])
    sizes = [len(req.pairs) for req in requests]
    starts = itertools.accumulate(sizes, initial=0)
    truncated = sum(bool(scorer.truncated(flat[a : a + n])) for a, n in zip(starts, sizes))
    scored = iter(score(flat))
    per_metric: dict[str, list[float]] = {m: [] for m in task.metric_names if m != "perplexity"}
    lls_all, records = [], []
    for doc_id, req in enumerate(requests):
        res = [next(scored) for _ in req.pairs]
        lls = [ll for ll, _ in res]
        ex = req.example
        if task.type == "multiple_choice":
            values = M.multiple_choice_metrics(lls, ex["choices"], ex["gold"])
        elif task.type == "schema":
            values = M.schema_metrics(lls, ex["gold"])
        else:  # language_modeling: greedy accuracy of the whole continuation
            values = {"acc": float(res[0][1])}
            lls_all.append(lls[0])
        for name, value in values.items():
            per_metric[name].append(value)
        records.append(
            {
                "doc_id": doc_id,
                "context": req.pairs[0][0],
                "loglikelihoods": lls,
                "is_greedy": [g for _, g in res],
                **values,
            }
        )
    summary = {name: (M.mean(v), M.mean_stderr(v)) for name, v in per_metric.items()}
    if task.type == "language_modeling":
        summary["perplexity"] = (M.perplexity(lls_all), None)
    return summary, records, truncated


def _score_generation_task(
    scorer: LMScorer, task: TaskConfig, requests, score: ScoreFn
) -> tuple[dict, list[dict], int]:
    contexts = [r.context for r in requests]
    preds = scorer.greedy_until(contexts, task.stop_sequences, task.max_new_tokens)
    room = scorer.max_length if scorer.seq2seq else scorer.max_length - task.max_new_tokens
    truncated = sum(len(scorer.encode(c)) > room for c in contexts if c)
    records, scores = [], []
    for doc_id, (req, pred) in enumerate(zip(requests, preds)):
        em = M.exact_match(pred, req.example["answer"], strip=task.strip, ignore_case=task.ignore_case)
        scores.append(em)
        records.append(
            {
                "doc_id": doc_id,
                "context": req.context,
                "prediction": pred,
                "answer": req.example["answer"],
                "exact_match": em,
            }
        )
    return {"exact_match": (M.mean(scores), M.mean_stderr(scores))}, records, truncated


def evaluate_task(
    scorer: LMScorer,
    task: TaskConfig,
    *,
    seed: int = DEFAULT_FEWSHOT_SEED,
    limit: int | None = None,
    score: ScoreFn | None = None,
) -> tuple[dict[str, Any], list[dict]]:
    """(summary, per-example records) of one task; ``limit`` overrides ``task.limit``."""
    limit = limit or task.limit
    score = score or scorer.loglikelihood_tokens
    chance = None
    if task.type == "perplexity":
        docs = load_documents(task.path, task.document, limit)
        values, records = evaluate_perplexity(scorer, docs, score)
        summary = {name: (value, None) for name, value in values.items()}
        n, truncated = len(docs), 0  # rolling windows fit by construction
    else:
        examples = load_examples(task.path, task.type)
        evaluated = examples[:limit] if limit else examples
        if task.fewshot_path:
            requests = build_requests(task, evaluated, load_examples(task.fewshot_path, task.type), seed)
        else:  # shots from the whole file (as lm-eval with --limit), never the evaluated example
            requests = build_requests(task, evaluated, examples, seed, exclude_evaluated=True)
        scorer_fn = _score_generation_task if task.type == "generation" else _score_loglikelihood_task
        summary, records, truncated = scorer_fn(scorer, task, requests, score)
        n, chance = len(evaluated), _chance(task, evaluated)
    result = {
        "type": task.type,
        "num_fewshot": task.num_fewshot,
        "num_examples": n,
        "seed": seed,
        "metrics": {name: value for name, (value, _) in summary.items()},
        "stderr": {name: se for name, (_, se) in summary.items()},
        "truncated": truncated,
    }
    if chance is not None:
        result["chance"] = chance
    return result, records


def evaluate(
    scorer: LMScorer,
    tasks: Sequence[TaskConfig],
    *,
    seed: int = DEFAULT_FEWSHOT_SEED,
    limit: int | None = None,
    log_samples: bool = False,
    score: ScoreFn | None = None,
) -> dict[str, Any]:
    """Every task's results (see the module docstring), the CORE-style aggregate, optional samples."""
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise InputError(f"task names must be unique, got {names}")
    out: dict[str, Any] = {"results": {}}
    if log_samples:
        out["samples"] = {}
    for task in tasks:
        result, records = evaluate_task(scorer, task, seed=seed, limit=limit, score=score)
        out["results"][task.name] = result
        if log_samples:
            out["samples"][task.name] = records
    return out | summarize(out["results"])


def summarize(results: dict[str, Any]) -> dict[str, float]:
    """``{"core": CORE-style aggregate}`` over the accuracy tasks of ``{task: result}`` (empty without any)."""
    accuracies = [(r["metrics"]["acc"], r["chance"]) for r in results.values() if "chance" in r]
    return {"core": M.core_score(accuracies)} if accuracies else {}


def truncation_report(results: dict[str, Any], max_length: int) -> list[str]:
    """One line per task whose prompts did not all fit the model's context."""
    lines = []
    for name, res in results["results"].items():
        if res.get("truncated"):
            lines.append(
                f"{name}: {res['truncated']} of {res['num_examples']} prompts longer than the model's "
                f"{max_length} tokens were cut from the left, keeping the continuation (lm-eval's rule); "
                "lower num_fewshot to fit"
            )
    return lines


def format_table(results: dict[str, Any]) -> str:
    """Markdown table: task, type, shots, n, seed, metric, value, stderr."""
    header = ["task", "type", "shots", "n", "seed", "metric", "value", "stderr"]
    rows = []
    for name, res in results["results"].items():
        for metric, value in res["metrics"].items():
            se = res["stderr"].get(metric)
            rows.append(
                [
                    name,
                    res["type"],
                    str(res["num_fewshot"]),
                    str(res["num_examples"]),
                    str(res["seed"]),
                    metric,
                    f"{value:.4f}",
                    "N/A" if se is None else f"{se:.4f}",
                ]
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def save_results(results: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2, ensure_ascii=False, allow_nan=True) + "\n")
    return path


def flat_metrics(results: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """``{"eval/<task>/<metric>": value, "eval/<task>/<metric>_stderr": se}`` for loggers."""
    flat = {}
    for name, res in results["results"].items():
        for metric, value in res["metrics"].items():
            flat[f"{prefix}/{name}/{metric}"] = value
            se = res["stderr"].get(metric)
            if se is not None and math.isfinite(se):
                flat[f"{prefix}/{name}/{metric}_stderr"] = se
        flat[f"{prefix}/{name}/truncated"] = float(res.get("truncated", 0))
    if "core" in results:
        flat[f"{prefix}/core"] = results["core"]
    return flat


def log_to_wandb(results: dict[str, Any], run: Any, step: int | None = None) -> None:
    """Log every metric to a W&B run (anything with ``.log``), and the table as a ``wandb.Table``."""
    payload: dict[str, Any] = dict(flat_metrics(results))
    try:
        import wandb

        columns: list[str | int] = ["task", "type", "shots", "n", "seed", "metric", "value", "stderr"]
        table = wandb.Table(columns=columns)
        for name, res in results["results"].items():
            for metric, value in res["metrics"].items():
                table.add_data(
                    name,
                    res["type"],
                    res["num_fewshot"],
                    res["num_examples"],
                    res["seed"],
                    metric,
                    value,
                    res["stderr"].get(metric),
                )
        payload["eval/results"] = table
    except ImportError:
        pass
    run.log(payload, step=step) if step is not None else run.log(payload)


def run_evaluation(config: EvalConfig, tasks: list[TaskConfig] | None = None) -> dict[str, Any]:
    """Load the tasks (validated; ``tasks`` when the caller has) and the scorer, evaluate, print the table; write
    JSON / log to W&B if asked."""
    import torch

    from .models import load_scorer

    tasks = load_tasks(config) if tasks is None else tasks
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    assert config.checkpoint is not None  # load_config requires one
    scorer = load_scorer(
        config.checkpoint,
        config.tokenizer,
        device=device,
        dtype=config.dtype,
        prefix_token=config.prefix_token,
        max_length=config.max_length,
        batch_size=config.batch_size,
        padding_side=config.padding_side,
        unpadded=config.unpadded,
    )
    results = evaluate(scorer, tasks, seed=config.seed, limit=config.limit, log_samples=config.log_samples)
    results["config"] = {**asdict(config), "device": device, "max_length": scorer.max_length}
    print(format_table(results))
    if "core" in results:
        n = sum("chance" in r for r in results["results"].values())
        print(f"CORE (accuracy centred on chance, mean of {n} tasks): {results['core']:.4f}")
    for line in truncation_report(results, scorer.max_length):
        print(f"warning: {line}")
    if config.output:
        print(f"results -> {save_results(results, config.output)}")
    if config.wandb_project or config.wandb_run_id:
        import wandb

        mode: Literal["online", "offline"] = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run = wandb.init(
            project=config.wandb_project or "pretrain",
            id=config.wandb_run_id,
            resume="allow",
            mode=mode,
            job_type="eval",
        )
        log_to_wandb(results, run)
        run.finish()
    return results
