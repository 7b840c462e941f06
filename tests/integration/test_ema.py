"""The weights' exponential moving average (``ema.decay``, ``pretrain.training.callbacks.ema``): on 2 gloo ranks under DDP,
FSDP2, ZeRO-2 and ZeRO-3 it equals one process's EMA to 1e-6 with no collective in its updates (every collective of
``torch.distributed`` and ``deepspeed.comm`` counted: ``tests/ema_worker.py``); it resumes bitwise, is validated as
``val/loss_ema`` and exported with ``pretrain export --ema``; ``ema.decay`` outside (0, 1) is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from training_utils import REPO_ROOT, metric_by_step, one_error_line, read_metrics, run_ranks, tiny_recipe

from pretrain.checkpoint.convert import ema_weights
from pretrain.cli import main

WORKER = REPO_ROOT / "tests" / "ema_worker.py"
STEPS = 6
EMA = ["ema.decay=0.9", "ema.every_n_steps=2", "ema.start_step=1"]
LAYOUTS = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "zero2": ["strategy.name=deepspeed", "strategy.deepspeed.stage=2"],
    "zero3": [
        "strategy.name=deepspeed",
        "strategy.deepspeed.stage=3",
        "strategy.deepspeed.param_persistence_threshold=0",
    ],
}


def recipe(directory, world, devices=2):
    directory.mkdir(parents=True, exist_ok=True)
    return tiny_recipe(
        directory,
        world,
        "gpt",
        trainer={"devices": devices, "max_steps": STEPS, "val_check_interval": 3, "limit_val_batches": 2},
        optim={"warmup_steps": 2, "decay_steps": STEPS},
        checkpoint={"every_n_steps": 3, "save_top_k": 0},
    )


def last(recipe_path):
    return recipe_path.parent / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_world):
    """One process, the same 8 samples per step."""
    path = recipe(tmp_path_factory.mktemp("ema_reference"), tiny_world, devices=1)
    assert main(["fit", str(path), "data.micro_batch_size=8", *EMA]) == 0
    return path


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, tiny_world):
    root = tmp_path_factory.mktemp("ema_layouts")
    commands: list[str] = []
    recipes = {}
    for name, overrides in LAYOUTS.items():
        recipes[name] = recipe(root / name, tiny_world)
        commands += [*(["+"] if commands else []), "fit", str(recipes[name]), *overrides, *EMA]
    run_ranks(WORKER, *commands, world_size=2, log_dir=root, timeout=1800)
    return recipes


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_each_rank_averages_its_part_with_no_collective(layouts, reference, name):
    expected = ema_weights(last(reference))
    averages = ema_weights(last(layouts[name]))
    assert averages.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(averages[key], value, rtol=0, atol=1e-6, msg=key)
    for rank in (0, 1):
        counts = json.loads((layouts[name].parent / "run" / f"collectives.rank{rank}.json").read_text())
        assert counts["in_ema_updates"] == 0 and counts["in_training"] > 0, counts
    assert metric_by_step(read_metrics(layouts[name].parent / "run"), "val/loss_ema")


@pytest.mark.slow
def test_resume_is_bitwise_validated_and_exported(reference, tmp_path, tiny_world, capsys):
    path = recipe(tmp_path / "resumed", tiny_world, devices=1)
    args = ["fit", str(path), "data.micro_batch_size=8", *EMA]
    assert main([*args, "trainer.max_steps=4"]) == 0 and main(args) == 0
    expected, resumed = ema_weights(last(reference)), ema_weights(last(path))
    assert all(torch.equal(resumed[k], v) for k, v in expected.items())
    losses = metric_by_step(read_metrics(reference.parent / "run"), "val/loss_ema")
    assert sorted(losses) == [3, 6] and metric_by_step(read_metrics(reference.parent / "run"), "val/loss")
    assert main(["export", str(last(reference)), str(tmp_path / "hf"), "--ema"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(exported["transformer.wte.weight"], expected["model.embed.tok.weight"])


def test_export_ema_of_a_run_without_one_is_refused_in_one_line(capsys, tiny_gpt_run, tmp_path):
    line = one_error_line(capsys, "export", tiny_gpt_run["ckpt"], tmp_path / "hf", "--ema")
    assert "holds no EMA weights; train with ema.decay set" in line


@pytest.mark.parametrize("decay", ["0", "1", "1.5", "-0.1"])
def test_decay_outside_0_1_is_refused_in_one_line(capsys, decay):
    line = one_error_line(capsys, "fit", REPO_ROOT / "recipes" / "gpt-tiny.yaml", f"ema.decay={decay}")
    assert "ema.decay must be in (0, 1)" in line and "ema.decay=null" in line
