"""The ``eval_during_fit`` section: validated with the run config; task data read when the callback is built."""

from __future__ import annotations

import json

import pytest

from pretrain import config
from pretrain.config.run import EvalDuringFitConfig
from pretrain.errors import InputError
from pretrain.training.callbacks.in_loop_eval import InLoopEvaluation


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval_during_fit.every_n_steps=0", "eval_during_fit.every_n_steps must be >= 1, got 0"),
        ("eval_during_fit.limit=0", "eval_during_fit.limit must be >= 1"),
        ("eval_during_fit.num_fewshot=-1", "eval_during_fit.num_fewshot must be >= 0"),
        ("eval_during_fit.tasks=[copx]", "eval_during_fit.tasks: unknown task 'copx'.*'copa'"),
        ("eval_during_fit.taks=[copa]", "did you mean tasks"),
    ],
)
def test_bad_sections_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        config.load("gpt-tiny", [override])


def test_shipped_piece_and_task_data_checked_before_training(tmp_path):
    run, resolved = config.load(
        "gpt-tiny", ["eval_during_fit.tasks=[copa,wikitext2]", f"eval_during_fit.data_root={tmp_path}"]
    )
    assert resolved["eval_during_fit"]["tasks"] == ["copa", "wikitext2"]
    with pytest.raises(InputError, match="copa.jsonl does not exist.*set eval_during_fit.data_root"):
        InLoopEvaluation(run.eval_during_fit)
    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"context": "a", "answer": "b"}) + "\n")
    task = tmp_path / "gen.yaml"
    task.write_text(f"name: gen\ntype: generation\npath: {gen}\n")
    with pytest.raises(ValueError, match=r"\['gen'\] are generation tasks"):
        InLoopEvaluation(EvalDuringFitConfig(tasks=[str(task)]))
    text = tmp_path / "ppl.jsonl"
    text.write_text(json.dumps({"text": "some words"}) + "\n")
    (tmp_path / "ppl.yaml").write_text(f"name: ppl\ntype: perplexity\npath: {text}\n")
    callback = InLoopEvaluation(EvalDuringFitConfig(tasks=[str(tmp_path / "ppl.yaml")], num_fewshot=5))
    assert callback.tasks[0].num_fewshot == 0  # shots are for prompted tasks only


def test_data_root_defaults_as_the_recipes_data_paths_and_its_error_names_the_recipe_key(
    monkeypatch, tmp_path
):
    """``eval_during_fit.data_root`` defaults to ``$PRETRAIN_SHARED_DATA`` (as the shipped pieces' paths); with
    none, a task file's ``${data_root}`` names the recipe key, not `pretrain evaluate`'s --data-root."""
    monkeypatch.setenv("PRETRAIN_SHARED_DATA", str(tmp_path))
    run, _ = config.load("gpt-tiny", ["eval_during_fit.tasks=[copa]"])
    assert run.eval_during_fit.data_root == str(tmp_path)
    with pytest.raises(InputError) as err:
        InLoopEvaluation(EvalDuringFitConfig(tasks=["copa"], data_root=None))
    assert "eval_during_fit.data_root" in str(err.value) and "--data-root" not in str(err.value)
