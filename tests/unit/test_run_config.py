"""Run configs: composition of pieces, recipe body and overrides; validation errors that name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pretrain import config
from pretrain.models.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
PRETRAINING = [
    "gpt-tiny",
    "gpt-tiny-fast",
    "bert-tiny",
    "t5-tiny",
    "ul2-tiny",
    "prefixlm-tiny",
    "gpt2-124m",
    "gpt2-350m",
    "bert-base",
    "bert-large",
    "t5-v1_1-base",
]
RECIPES = [REPO_ROOT / "recipes" / f"{name}.yaml" for name in PRETRAINING]


def write(path: Path, body: dict) -> Path:
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(recipe):
    run, resolved = config.load(recipe)
    assert isinstance(run.model, ModelConfig)
    assert resolved["name"] == recipe.stem
    assert config.validate(resolved) == run  # the saved dict round-trips


def test_pieces_then_recipe_then_overrides(tmp_path):
    recipe = write(
        tmp_path / "r.yaml",
        {
            "defaults": ["model/gpt-tiny", "optim/tiny", "objective/ul2", "data/shakespeare"],
            "name": "x",
            "optim": {"lr": 0.5},
            "data": {"seq_len": 64},
        },
    )
    run, resolved = config.load(
        recipe, ["optim.warmup_steps=7", "model.n_layer=1", "data.sources.0.weight=2"]
    )
    assert run.model.d_model == 128  # from the piece, placed under its group
    assert run.optim.lr == 0.5  # the recipe beats the piece
    assert run.optim.warmup_steps == 7 and run.model.n_layer == 1  # overrides beat both
    assert run.data.sources[0].weight == 2.0 and run.data.sources[0].name == "tinyshakespeare"
    assert run.objective.options["input_length"] == 64  # ${data.seq_len} resolved after merging
    assert run.run_dir == "runs/x" and run.checkpoint_dir == Path("runs/x/checkpoints")
    assert resolved["optim"]["lr"] == 0.5


def test_unknown_key_names_path_and_closest_keys():
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'warmup_step' at optim.warmup_step; did you mean "
        r"warmup_steps\b",
    ):
        config.load(REPO_ROOT / "recipes/gpt-tiny.yaml", ["optim.warmup_step=3"])
    with pytest.raises(ValueError, match=r"'n_layers' at model.n_layers; did you mean n_layer"):
        config.load(REPO_ROOT / "recipes/gpt-tiny.yaml", ["model.n_layers=3"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=ten", r"trainer.max_steps: expected int, got str 'ten'"),
        ("model.d_model=1.5", r"model.d_model: expected int, got float 1.5"),
        ("trainer.compile=3", r"trainer.compile: expected bool"),
        ("optim.betas=0.9", r"optim.betas: expected a list"),
        ("optim.schedule=cosin", r"'cosin' is not one of .*did you mean 'cosine'"),
        ("strategy.name=horovod", r"strategy.name: 'horovod' is not one of"),
        ("trainer.precision=64", r"trainer.precision: '64' is not one of"),
        ("model.arch=rnn", r"model.arch must be one of"),
        ("data.seq_len=4096", r"data.seq_len=4096 exceeds model.max_seq_len=256"),
        ("trainer.max_steps", r"not of the form key=value"),
        ("trainer.gc_every_n_steps=-1", r"trainer.gc_every_n_steps must be >= 0 \(0 or null: Python's"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        config.load(REPO_ROOT / "recipes/gpt-tiny.yaml", [override])


def test_precision_shorthands_and_numbers():
    run, _ = config.load(REPO_ROOT / "recipes/gpt-tiny.yaml", ["trainer.precision=32"])
    assert run.trainer.precision == "32-true"
    run, _ = config.load(REPO_ROOT / "recipes/gpt-tiny.yaml", ["trainer.precision=bf16", "optim.lr=1"])
    assert run.trainer.precision == "bf16-mixed" and run.optim.lr == 1.0 and isinstance(run.optim.lr, float)


def test_missing_piece_lists_the_group(tmp_path):
    recipe = write(tmp_path / "r.yaml", {"defaults": ["strategy/zero9"]})
    with pytest.raises(FileNotFoundError, match=r"strategy/zero9.*deepspeed_zero2"):
        config.load(recipe)


def test_missing_recipe():
    with pytest.raises(FileNotFoundError, match=r"ready recipes \(by name\): .*'gpt-tiny'"):
        config.load("recipes/nope.yaml")


def test_shipped_recipes_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run, _ = config.load("gpt-tiny")
    assert run.name == "gpt-tiny" and config.load("recipes/gpt-tiny.yaml")[0].name == "gpt-tiny"
    for path in [*run.data.sources[0].text, *run.tokenizer.train_files]:  # shipped data: package paths
        assert Path(path).is_file(), path


def test_gpt2_recipe_steps_half_a_million_tokens_on_8_devices():
    run, _ = config.load(REPO_ROOT / "recipes/gpt2-124m.yaml")
    assert run.data.micro_batch_size * run.trainer.accumulate_grad_batches * 8 * run.data.seq_len == 524_288


def test_objective_names_are_the_pretraining_objectives_of_the_registry():
    """``ObjectiveName`` (the one list of names) is exactly ``objectives.OBJECTIVES`` minus the word-vector ones."""
    import typing

    from pretrain import objectives
    from pretrain.config.run import ObjectiveName

    assert set(typing.get_args(ObjectiveName)) == set(objectives.OBJECTIVES) - {"sgns"}


def test_config_pieces_of_different_verbs_do_not_share_a_name():
    """``optim/bert`` means one file: the finetuning pieces (``configs/finetune/``) never reuse a pretraining
    piece's group/name."""
    from pretrain.config import CONFIG_DIR

    pretraining = {p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_DIR.glob("*/*.yaml")}
    finetune = CONFIG_DIR / "finetune"
    finetuning = {p.relative_to(finetune).as_posix() for p in finetune.glob("*/*.yaml")}
    assert finetuning and not pretraining & finetuning, sorted(pretraining & finetuning)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps must be >= 1, got 0"),
        (
            "checkpoint.save_top_k=-2",
            r"checkpoint.save_top_k must be >= -1 \(0: no best checkpoints, -1: every",
        ),
        (
            "checkpoint.async_write_share=0",
            r"checkpoint.async_write_share must be in \(0, 1\] \(1: write as fast as the storage takes it\), got 0",
        ),
        ("checkpoint.async_write_share=1.5", r"checkpoint.async_write_share must be in \(0, 1\].*got 1.5"),
    ],
)
def test_checkpoint_bounds_are_refused_at_validation(override, message):
    with pytest.raises(ValueError, match=message):
        config.load("gpt-tiny", [override])


def test_every_config_problem_is_reported_at_once():
    """As litgpt's validate_args: one error lists them all, so one edit of the recipe fixes them."""
    bad = ["trainer.max_steps=0", "data.micro_batch_size=0", "optim.lr=0", "guards.spike.k=0", "optim.eps=0"]
    with pytest.raises(ValueError, match=r"^5 problems in the config: ") as caught:
        config.load("gpt-tiny", bad)
    for fragment in ("trainer.max_steps", "data.micro_batch_size", "optim.lr", "guards.spike.k", "optim.eps"):
        assert fragment in str(caught.value)
