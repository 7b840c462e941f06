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
        ("data.document_mask=3", "data.document_mask: expected bool, got int 3"),
        ("name=${modle.d_model}", "cannot resolve name: Interpolation key 'modle.d_model' not found"),
        # issue 32: values every bound check let through, a key that only looks right, YAML cut short
        ("optim.lr=.nan", "optim.lr: expected a number, got nan"),
        ("optim.lr=.inf", "optim.lr must be a finite number > 0, got inf"),
        ('name="a\\nb"', "no '/', '\\', '..' or control characters such as a line break"),
        ("eval_during_fit.tasks=[copa,copa]", "eval_during_fit.tasks lists ['copa'] twice"),
        ("trainer={max_steps: 1", "override 'trainer={max_steps: 1': the value is not valid YAML"),
        # an empty value (`name=` is null) for a key that needs one: named as such, not "got NoneType None"
        ("name=", "name: needs a value (str), got none (an empty override `name=` or null)"),
        # was "resume: expected str, got bool True" (#32 sweep)
        ("resume=yes", "resume: expected text, got the boolean True (YAML reads an unquoted yes, no, on"),
        ("resume=yes", "; resume is auto, null or a checkpoint path"),
        ("trainer.max_steps=", "trainer.max_steps: needs a value (int), got none"),
        (
            "tr\u0430iner.max_steps=1",
            "'\u0430' (U+0430 CYRILLIC SMALL LETTER A) at position 3; retype it (did you mean trainer",
        ),
    ],
)
def test_override_errors_are_one_line(capsys, override, message):
    assert message in one_error_line(capsys, "fit", GPT_TINY, override, "--print-config")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfename: x\n", "is not a YAML text file (invalid start byte at byte 0: not UTF-8)"),
        (b"- model/gpt-tiny\n- name: x\n", "a recipe is a YAML mapping (key: value lines), got a list"),
        (b"", "is empty; give a recipe with its keys"),  # before: a run of every default
        (None, "is a directory; give a recipe YAML file in it"),
    ],
)
def test_a_recipe_that_is_no_mapping_of_text_is_one_line(capsys, tmp_path, content, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.mkdir() if content is None else recipe.write_bytes(content)
    assert message in one_error_line(capsys, "fit", recipe, "--print-config")


@pytest.mark.parametrize(
    "variable, message",
    [
        (
            'name="x',
            """PRETRAIN_OVERRIDES='name="x': no closing quotation; it is split into key=value words""",
        ),
        ("trainer.max_stepz=1", "at trainer.max_stepz; did you mean max_steps?"),
    ],
)
def test_pretrain_overrides_errors_say_where_the_value_came_from(capsys, monkeypatch, variable, message):
    monkeypatch.setenv("PRETRAIN_OVERRIDES", variable)
    line = one_error_line(capsys, "fit", GPT_TINY, "--print-config")
    assert message in line and "PRETRAIN_OVERRIDES=" in line


def test_a_command_line_setting_the_variable_replaces_is_said_so(capsys, monkeypatch):
    """PRETRAIN_OVERRIDES=trainer.max_steps=7 with `pretrain fit ... trainer.max_steps=3`: the run took 7 without
    a word (a variable left exported from another shell silently overrode what the command says)."""
    from pretrain.cli import main

    monkeypatch.setenv("PRETRAIN_OVERRIDES", "trainer.max_steps=7 seed=3")
    assert (
        main(["fit", str(GPT_TINY), "trainer.max_steps=3", "logger.wandb.enabled=false", "--print-config"])
        == 0
    )
    out, err = capsys.readouterr()
    assert "  max_steps: 7" in out
    lines = [line for line in err.splitlines() if "PRETRAIN_OVERRIDES sets" in line]
    assert lines == [
        "pretrain fit: PRETRAIN_OVERRIDES sets trainer.max_steps=7 over the command line's trainer.max_steps=3"
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective=prefix_lm", "config piece objective/prefix_lm ("),
        ("objective=prefix_lm", "; to set the section's name: objective.name=prefix_lm"),
        ("strategy=fsdp", "defaults list (defaults: [..., strategy/fsdp]), not by a strategy=fsdp override"),
        ("strategy=fsdp", "strategy.name=fsdp"),
        ("objective=nope", "got 'nope'; to set the section's name: objective.name=nope"),
    ],
)
def test_a_section_set_to_a_word_names_the_piece_or_the_name_key(capsys, override, message):
    """`pretrain fit gpt-tiny objective=prefix_lm` (or strategy=fsdp, finetune lora=r8: a config group picked as
    other tools do) said only 'expected a section of key: value settings, got ...': now the piece of that name
    and the name key are named. Found by the #32 sweep."""
    assert message in one_error_line(capsys, "fit", GPT_TINY, override)


def test_a_recipe_listed_in_defaults_is_named_as_such(capsys, tmp_path):
    """A recipe whose defaults list another recipe (defaults: [/abs/recipes/gpt-tiny]) said "unknown config key '/'
    at /": the path's first part was taken for the group. Found by the #32 sweep."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"defaults: [{GPT_TINY.with_suffix('')}]\nname: mine\n")
    line = one_error_line(capsys, "fit", recipe)
    assert "is a recipe (it has defaults of its own); defaults name config pieces as group/name" in line
    (tmp_path / "base.yaml").write_text(GPT_TINY.read_text())  # a recipe beside it, by a relative name
    recipe.write_text("defaults: [base]\nname: mine\n")
    assert "defaults entry 'base' is a recipe" in one_error_line(capsys, "fit", recipe)


def test_a_recipe_beyond_omegaconfs_node_limit_loads(tmp_path):
    """10,001 input files: past OmegaConf's 10,000-node YAML limit (before: its alias-bomb error, naming no key)."""
    from pretrain.config.compose import load_yaml

    files = [f"part-{i:05d}.txt" for i in range(10_001)]
    recipe = tmp_path / "many.yaml"
    recipe.write_text(f"data:\n  sources:\n    - name: all\n      text: [{', '.join(files)}]\n")
    text = load_yaml(recipe).data.sources[0].text
    assert len(text) == len(files) and text[-1] == files[-1]


def test_async_save_under_deepspeed_is_refused_in_one_line(capsys):
    line = one_error_line(capsys, "fit", GPT_TINY, "strategy.name=deepspeed", "checkpoint.async_save=true")
    assert "checkpoint.async_save=true is not supported with strategy deepspeed" in line
    assert "checkpoint.async_save=false" in line


def test_an_option_for_a_setting_names_the_override_form(capsys):
    """`pretrain fit gpt-tiny --max-steps 3` said only 'unrecognized arguments: --max-steps 3'; the line now says
    settings are key=value overrides. Found by the #32 sweep."""
    from pretrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", str(GPT_TINY), "--max-steps", "3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "settings are key=value overrides, e.g. trainer.max_steps=100" in err
