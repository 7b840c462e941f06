"""Token-weighted loss over the global batch (objectives/loss.py) and the metrics of the objectives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from objective_data import build

from objectives.loss import IGNORE_INDEX, global_mean, micro_batch_loss, token_cross_entropy


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


def test_accumulated_gradient_equals_global_token_mean():
    """Micro-batches with very different target counts: the accumulated gradient of micro_batch_loss over
    2 'ranks' x 2 micro-batches equals that of the global token mean, and differs from the mean of means."""
    parts = [random_batch(s, keep=k) for s, k in zip(range(4), (0.9, 0.1, 0.5, 0.2))]
    weight = torch.randn(11, 11, requires_grad=True)

    def sums(i):
        logits, labels = parts[i]
        return token_cross_entropy(logits @ weight, labels)

    total = sum(sums(i)[1] for i in range(4))
    reference = global_mean([sums(i)[0] for i in range(4)], [sums(i)[1] for i in range(4)])
    (expected,) = torch.autograd.grad(reference, weight)

    world_size = 2
    rank_grads = []
    for rank in range(world_size):  # DDP averages the ranks' accumulated gradients
        loss = sum(micro_batch_loss(sums(i)[0], total, world_size) for i in (2 * rank, 2 * rank + 1))
        rank_grads.append(torch.autograd.grad(loss, weight)[0])
    torch.testing.assert_close(sum(rank_grads) / world_size, expected)

    mean_of_means = sum(sums(i)[0] / sums(i)[1] for i in range(4)) / 4
    assert not torch.allclose(mean_of_means, reference, rtol=1e-3)


def test_global_mean_accepts_stacked_tensors():
    torch.testing.assert_close(global_mean(torch.tensor([2.0, 4.0]), torch.tensor([1, 3])), torch.tensor(1.5))


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
