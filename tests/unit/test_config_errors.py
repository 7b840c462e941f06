"""Config input that used to give a raw OmegaConf report, a misleading message or a wrong run (issue 22): one line
naming the key and the fix, from the ``pretrain`` command with exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from training_utils import one_error_line

from pretrain import config

GPT_TINY = Path(__file__).resolve().parents[2] / "recipes" / "gpt-tiny.yaml"


def test_a_run_name_cannot_escape_the_runs_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(capsys, "fit", GPT_TINY, "name=../../escaped")
    assert "must be a plain run name" in line and "run_dir=PATH" in line
    assert not any(tmp_path.parent.parent.glob("escaped"))
    assert config.load(GPT_TINY, ["run_dir=elsewhere/run"])[0].run_dir == "elsewhere/run"  # the named fix


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.sources={name: x}", "data.sources is a list; give a list (data.sources=[{...}])"),
        ("data.sources.name=x", "address an item by its index (data.sources.0.name=...)"),
        (
            "objective.options.document_masking=3",
            "objective.options.document_masking: expected bool, got int 3",
        ),
        ("name=${modle.d_model}", "cannot resolve name: Interpolation key 'modle.d_model' not found"),
    ],
)
def test_override_errors_are_one_line(capsys, override, message):
    assert message in one_error_line(capsys, "fit", GPT_TINY, override)


def test_an_override_may_interpolate_another_key():
    run, _ = config.load(GPT_TINY, ["name=gpt-d${model.d_model}"])
    assert run.name == f"gpt-d{run.model.d_model}"


def test_sources_given_as_a_mapping_in_a_recipe(capsys, tmp_path):
    recipe = tmp_path / "mapping.yaml"
    recipe.write_text("defaults: [data/shakespeare]\nname: m\ndata:\n  sources: {name: x, text: [a.txt]}\n")
    line = one_error_line(capsys, "fit", recipe)
    assert "data.sources is a list in one place and a mapping in another" in line


def test_a_recipe_listing_itself_in_its_defaults(capsys, tmp_path):
    recipe = tmp_path / "loop.yaml"
    recipe.write_text("defaults: [model/gpt-tiny, loop]\nname: loop\n")
    assert "its defaults list the recipe itself ('loop')" in one_error_line(capsys, "fit", recipe)


def test_a_monitor_naming_no_logged_metric_is_refused_before_training(capsys, tmp_path, tiny_world):
    from training_utils import tiny_recipe

    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", checkpoint={"monitor": "val/los", "save_top_k": 1})
    line = one_error_line(capsys, "fit", recipe)
    assert "checkpoint.monitor='val/los' is not a metric the validation logs" in line and "'val/loss'" in line
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


@pytest.mark.parametrize(
    "monitor, mode",
    [
        ("val/loss", "min"),
        ("val/perplexity", "min"),
        ("val/accuracy", "max"),
        ("val/exact_match", "max"),
        ("val/f1", "max"),
        ("val/mcc", "max"),
    ],
)
def test_checkpoint_mode_follows_the_metric_name(monitor, mode):
    from pretrain.config.run import CheckpointConfig, check_checkpoint

    c = CheckpointConfig(monitor=monitor)
    check_checkpoint(c)
    assert c.mode == mode
    explicit = CheckpointConfig(monitor=monitor, mode="min" if mode == "max" else "max")
    check_checkpoint(explicit)
    assert explicit.mode != mode  # a given mode is kept


def test_checkpoint_mode_is_required_when_the_name_does_not_tell(capsys, tmp_path):
    from pretrain.config.run import CheckpointConfig, check_checkpoint

    with pytest.raises(ValueError, match="set checkpoint.mode=max or checkpoint.mode=min"):
        check_checkpoint(CheckpointConfig(monitor="val/score"))
    line = one_error_line(capsys, "fit", GPT_TINY, "checkpoint.mode=best")
    assert "checkpoint.mode" in line and "'min'" in line and "'max'" in line
