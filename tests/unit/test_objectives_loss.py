"""Token cross-entropy as (sum, count) (objectives/loss.py; the global-batch normalisation of the training step is
tested against one big batch in tests/integration/test_module.py) and the metrics of the objectives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from objective_data import build

from pretrain.objectives.loss import IGNORE_INDEX, token_cross_entropy


def random_batch(seed: int, B: int = 4, T: int = 7, V: int = 11, keep: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) > keep] = IGNORE_INDEX
    return logits, labels


def test_token_cross_entropy_is_sum_and_count():
    logits, labels = random_batch(0)
    loss_sum, n = token_cross_entropy(logits, labels)
    assert n == (labels != IGNORE_INDEX).sum()
    mean = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss_sum / n, mean)


def test_bfloat16_logits_are_summed_in_float32():
    logits, labels = random_batch(1, T=64, V=50)
    exact, _ = token_cross_entropy(logits.bfloat16().float(), labels)
    torch.testing.assert_close(token_cross_entropy(logits.bfloat16(), labels)[0], exact)


def test_metrics_sum_across_batches_to_global_accuracy_and_perplexity():
    clm = build("clm")
    parts = [random_batch(s, keep=k) for s, k in zip(range(3), (0.9, 0.2, 0.6))]
    per_part = [clm.metrics(logits, labels) for logits, labels in parts]
    totals = {k: sum(m[k] for m in per_part) for k in per_part[0]}
    summary = clm.summarize(totals)

    logits = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    target = labels != IGNORE_INDEX
    mean = F.cross_entropy(logits[target], labels[target]).item()
    assert math.isclose(summary["loss"], mean, rel_tol=1e-5)
    assert math.isclose(summary["perplexity"], math.exp(mean), rel_tol=1e-5)
    correct = (logits.argmax(-1)[target] == labels[target]).sum().item()
    assert math.isclose(summary["accuracy"], correct / target.sum().item())
    assert "perplexity" not in build("mlm").summarize(totals)


def test_a_batch_without_targets_reports_undefined_metrics_not_a_perfect_loss():
    """All labels ignored: the summed loss is 0 over 0 targets; the logged loss must not read as 0."""
    logits, labels = random_batch(0, keep=0.0)
    totals = build("clm").metrics(logits, labels)
    assert int(totals["num_targets"]) == 0
    summary = build("clm").summarize(totals)
    assert all(math.isnan(summary[k]) for k in ("loss", "accuracy", "perplexity")), summary
