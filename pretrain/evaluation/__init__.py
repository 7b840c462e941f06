"""In-context (few-shot) evaluation and perplexity with lm-evaluation-harness's semantics.

    from pretrain.evaluation import evaluate, load_scorer, load_task

    scorer = load_scorer("runs/gpt-tiny", batch_size=16)
    tasks = [load_task("configs/eval/copa.yaml", data_root="/data/llm-eval", overrides={"num_fewshot": 5})]
    results = evaluate(scorer, tasks, seed=1234)

Modules: ``tasks`` (YAML task files, JSONL validation), ``prompts`` (k-shot prompts, seeded sampler),
``scoring`` (``LMScorer``: batched log-likelihood, an encoder's pseudo-log-likelihood, greedy decoding), ``metrics``, ``perplexity`` (rolling
windows), ``models`` (our Transformer / checkpoints -> ``LMScorer``), ``runner`` (results, table, W&B),
``config`` (``EvalConfig``, composed and validated like every verb), ``cli`` (``pretrain evaluate``
arguments), ``lm_eval_adapter`` (lm-eval model ``"pretrain"``; needs ``lm-eval``).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import load_model_and_tokenizer, load_scorer, scorer_from_model
    from .runner import evaluate, evaluate_task, format_table, log_to_wandb, save_results
    from .scoring import LMScorer, UnsupportedModelError
    from .tasks import TaskConfig, load_examples, load_task

# name -> module: imported on first use, so that `pretrain evaluate` checks its config before torch is imported
_EXPORTS = {
    "LMScorer": "scoring",
    "TaskConfig": "tasks",
    "UnsupportedModelError": "scoring",
    "evaluate": "runner",
    "evaluate_task": "runner",
    "format_table": "runner",
    "load_examples": "tasks",
    "load_model_and_tokenizer": "models",
    "load_scorer": "models",
    "load_task": "tasks",
    "log_to_wandb": "runner",
    "save_results": "runner",
    "scorer_from_model": "models",
}
__all__ = [
    "LMScorer",
    "TaskConfig",
    "UnsupportedModelError",
    "evaluate",
    "evaluate_task",
    "format_table",
    "load_examples",
    "load_model_and_tokenizer",
    "load_scorer",
    "load_task",
    "log_to_wandb",
    "save_results",
    "scorer_from_model",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
