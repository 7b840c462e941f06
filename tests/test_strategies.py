"""The strategy matrix: DDP, FSDP (FSDP2 per block) and DeepSpeed ZeRO-1/2/3 on 2 gloo ranks train tiny GPT / BERT /
T5 to the same losses (relative 1e-5 over 10 steps), with the same weight-decayed parameters and the same FLOPs on
every rank -- with gradient accumulation, activation checkpointing and bf16-mixed (whose gradients must be reduced
in float32 under FSDP as under DDP, or the losses part).

All cells run in one launch of 2 ranks (``strategy_worker.py``); the reference of each cell is the DDP cell of the
same model, accumulation and precision. Every trainer piece clips gradient norms at 1.0 and the tiny models'
gradient norms exceed it, so clipping is part of what must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_utils import metric_by_step, read_metrics, run_ranks, tiny_recipe, tiny_world  # noqa: F401

WORKER = Path(__file__).with_name("strategy_worker.py")
STRATEGY = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    **{f"zero{k}": ["strategy.name=deepspeed", f"strategy.deepspeed.stage={k}"] for k in (1, 2, 3)},
}
# (model, accumulation, extra overrides, strategies besides the DDP reference)
GROUPS = [
    ("gpt", 1, [], ["fsdp", "zero1", "zero2", "zero3"]),
    ("gpt", 2, [], ["fsdp", "zero2", "zero3"]),
    ("gpt", 2, ["trainer.activation_checkpointing=true"], ["fsdp", "zero3"]),
    ("gpt", 1, ["trainer.precision=bf16-mixed"], ["fsdp"]),
    ("bert", 2, [], ["fsdp", "zero3"]),
    ("t5", 1, [], ["fsdp", "zero2"]),
]


def group_name(kind: str, k: int, extra: list[str]) -> str:
    return "-".join([kind, f"acc{k}", *(e.split(".")[-1].replace("=", "_") for e in extra)])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny_world):  # noqa: F811
    """Trains every cell once; ``{group: {strategy: cell directory}}``."""
    root = tmp_path_factory.mktemp("matrix")
    cells, layout = [], {}
    for kind, k, extra, strategies in GROUPS:
        group = group_name(kind, k, extra)
        for strategy in ["ddp", *strategies]:
            directory = root / group / strategy
            directory.mkdir(parents=True)
            recipe = tiny_recipe(
                directory,
                tiny_world,
                kind,
                trainer={"devices": 2, "max_steps": 10, "val_check_interval": 100, "accumulate_grad_batches": k},
                checkpoint={"every_n_steps": 100, "save_top_k": 0},
            )
            name = f"{group}.{strategy}"
            cells.append({"name": name, "recipe": str(recipe), "overrides": [*STRATEGY[strategy], *extra]})
            layout.setdefault(group, {})[strategy] = directory
    (root / "cells.json").write_text(json.dumps(cells))
    (root / "out").mkdir()
    run_ranks(WORKER, str(root / "cells.json"), str(root / "out"), log_dir=root)
    return root, layout


CELLS = [(group_name(kind, k, extra), s) for kind, k, extra, strategies in GROUPS for s in strategies]


@pytest.mark.slow
@pytest.mark.parametrize(("group", "strategy"), CELLS, ids=[f"{g}-{s}" for g, s in CELLS])
def test_strategy_matches_ddp(matrix, group, strategy):
    root, layout = matrix
    losses = {
        name: metric_by_step(read_metrics(layout[group][name] / "run"), "train/loss") for name in ("ddp", strategy)
    }
    assert sorted(losses["ddp"]) == list(range(10)) and len(set(losses["ddp"].values())) > 1
    assert sorted(losses[strategy]) == list(range(10))
    worst = max(abs(losses[strategy][s] - v) / abs(v) for s, v in losses["ddp"].items())
    print(f"{group} {strategy}: max relative loss difference to DDP {worst:.2e}")
    assert worst <= 1e-5, (losses["ddp"], losses[strategy])

    def result(name: str, rank: int) -> dict:
        return json.loads((root / "out" / f"{group}.{name}.rank{rank}.json").read_text())

    reference = result("ddp", 0)
    assert reference["decayed"] > 0 and len(reference["flops"]) == 10 * int(group.split("acc")[1][0])
    for rank in (0, 1):
        assert result(strategy, rank)["decayed"] == reference["decayed"]
        assert result(strategy, rank)["flops"] == reference["flops"]
