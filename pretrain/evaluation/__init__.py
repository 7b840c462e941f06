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

from .models import load_model_and_tokenizer, load_scorer, scorer_from_model
from .runner import evaluate, evaluate_task, format_table, log_to_wandb, save_results
from .scoring import LMScorer, UnsupportedModelError
from .tasks import TaskConfig, load_examples, load_task

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
