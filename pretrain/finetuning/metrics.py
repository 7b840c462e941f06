"""Finetuning metrics (torchmetrics): accuracy, f1 (binary: positive class = the second label; else macro),
mcc (Matthews), pearson, spearman (regression); text-to-text: accuracy (exact match) and bleu (sacrebleu)."""

from __future__ import annotations

from collections.abc import Callable

import torchmetrics

from pretrain.errors import InputError
from pretrain.finetuning.config import FinetuneConfig

CLASS_METRICS = ("accuracy", "f1", "mcc")


REGRESSION_METRICS = ("pearson", "spearman")


TEXT_METRICS = ("accuracy", "bleu")


GLUE_METRICS = {  # the GLUE benchmark's metrics per task
    "cola": ["mcc", "accuracy"],
    "mrpc": ["accuracy", "f1"],
    "qqp": ["accuracy", "f1"],
    "stsb": ["pearson", "spearman"],
}


def default_metrics(cfg: FinetuneConfig, regression: bool) -> list[str]:
    if cfg.metrics is not None:
        return list(cfg.metrics)
    if cfg.head.kind == "text2text":
        return ["bleu"] if cfg.data.train_target_file else ["accuracy"]
    task = (cfg.data.task or "").lower().replace("-", "").replace("_", "")
    if task in GLUE_METRICS:
        return GLUE_METRICS[task]
    return list(REGRESSION_METRICS) if regression else ["accuracy"]


def build_metrics(names: list[str], num_labels: int, regression: bool) -> torchmetrics.MetricCollection:
    """torchmetrics for predictions (B,) of ``num_labels`` classes, or (B,) scores when ``regression``."""
    allowed = REGRESSION_METRICS if regression else CLASS_METRICS
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise InputError(
            f"metrics {unknown or names} do not apply to {'regression' if regression else 'classification'}; "
            f"choose from {list(allowed)}"
        )
    c = torchmetrics.classification
    table: dict[str, Callable[[], torchmetrics.Metric]] = {
        "accuracy": lambda: c.MulticlassAccuracy(num_labels, average="micro"),
        "f1": lambda: (
            c.BinaryF1Score() if num_labels == 2 else c.MulticlassF1Score(num_labels, average="macro")
        ),
        "mcc": lambda: c.MulticlassMatthewsCorrCoef(num_labels),
        "pearson": torchmetrics.PearsonCorrCoef,
        "spearman": torchmetrics.SpearmanCorrCoef,
    }
    return torchmetrics.MetricCollection({n: table[n]() for n in names})
