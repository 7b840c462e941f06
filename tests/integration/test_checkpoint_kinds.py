"""Every verb on every kind of checkpoint `pretrain fit` writes: a single file (DDP), an FSDP directory of DCP
shards, a DeepSpeed ZeRO-3 directory (trained with ``trainer.compile=true``, as the 8-GPU recipes do). Each kind is
written once, by 2 gloo ranks through the CLI; then validate, generate, export (transformers logits equal ours),
evaluate, finetune and resume must work on it.

The three runs train the same model on the same data and match to ~1e-7 (see test_strategies.py), so each sharded
kind is checked against the single file: its weights, its validation loss, its resumed losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_utils import (
    CORPUS,
    Background,
    metric_by_step,
    read_metrics,
    run_cli,
    tiny_recipe,
)

from pretrain.checkpoint import consolidate, is_valid, kind, load_model, payload
from pretrain.cli import main

KINDS = {
    "file": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "deepspeed": ["strategy.name=deepspeed", "strategy.deepspeed.stage=3", "trainer.compile=true"],
}
STEPS = 6

pytestmark = pytest.mark.heavy  # make test-all


def train_recipe(directory: Path, world: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return tiny_recipe(
        directory,
        world,
        "gpt",
        trainer={"devices": 2, "max_steps": STEPS, "val_check_interval": 3},
        checkpoint={"every_n_steps": 3, "save_top_k": 1},
    )


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, tiny_world):
    """``{kind: recipe}``, each trained for 6 steps (checkpoints at 3 and 6, the best one kept)."""
    root = tmp_path_factory.mktemp("kinds")
    recipes, runs = {}, {}
    for name, overrides in KINDS.items():
        recipes[name] = train_recipe(root / name, tiny_world)
        runs[name] = Background("fit", str(recipes[name]), *overrides, log=root / f"{name}.log")
    for run in runs.values():
        run.wait(timeout=900)
    return recipes


def last(recipe: Path) -> Path:
    return recipe.parent / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_layout_is_complete_and_atomic(kinds, name):
    checkpoints = last(kinds[name]).parent
    assert kind(last(kinds[name])) == {"fsdp": "dcp"}.get(name, name) and is_valid(last(kinds[name]))
    assert payload(last(kinds[name]))["config"]["trainer"]["max_steps"] == STEPS
    names = sorted(p.name for p in checkpoints.iterdir())
    assert "last.ckpt" in names and len(names) == 2, names  # + the best one; no temporary leftovers
    if name == "deepspeed":  # the engine's micro-batch is the real one, not Lightning's fallback of 1
        states = next(last(kinds[name]).glob("checkpoint/*mp_rank_00_model_states.pt"))
        ds_config = torch.load(states, weights_only=True)["ds_config"]
        assert ds_config["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "deepspeed"])
def test_weights_match_the_single_file_run(kinds, name):
    reference, _, _ = load_model(last(kinds["file"]))
    model, info, tokenizer = load_model(last(kinds[name]))
    assert tokenizer is not None and info["config"]["strategy"]["name"] == KINDS[name][0].split("=")[1]
    ids = torch.tensor([tokenizer.encode("ROMEO: what light").ids])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def assert_same_training_state(ours: dict, reference: dict, what: str) -> None:
    """Weights and each parameter's Adam moments and step of two checkpoints of the same training, within 1 % of
    each tensor's largest value (ZeRO-3 + compile and DDP part by up to 2e-4 of it in 6 steps; a parameter's state
    under another's name differs wholly)."""
    assert ours.keys() == reference.keys(), what
    for name, value in reference.items():
        if str(name).endswith("attn.k.bias"):  # its gradient is zero up to rounding: AdamW steps it by noise
            continue
        if isinstance(value, dict):
            assert_same_training_state(ours[name], value, f"{what}.{name}")
        elif isinstance(value, torch.Tensor):
            scale = value.float().abs().max().item()
            torch.testing.assert_close(ours[name].float(), value.float(), rtol=0, atol=0.01 * scale, msg=what)


@pytest.mark.slow
def test_convert_every_kind_to_one_file_and_to_dcp(kinds, tmp_path, capsys):
    """``pretrain convert`` (tensor by tensor): every kind as one file holds what the DDP run's file holds (weights,
    Adam moments by position, step), and as a DCP directory what FSDP2's own directory holds under each parameter
    name; ``--to hf`` is ``pretrain export``; a layout a checkpoint has already, or an existing output, is refused
    in one line."""
    from safetensors.torch import load_file
    from training_utils import one_error_line

    from pretrain.checkpoint import dcp, read
    from pretrain.checkpoint.optimizer_state import optimizer_state_by_names
    from pretrain.models.config import ModelConfig
    from pretrain.optim import group_param_names

    file, fsdp = read(last(kinds["file"])), dcp.read(last(kinds["fsdp"]))
    config = payload(last(kinds["file"]))["config"]
    names = group_param_names(ModelConfig(**config["model"]), config["optim"]["weight_decay"])

    def by_name(checkpoint: dict) -> dict:
        optimizer = optimizer_state_by_names(checkpoint["optimizer_states"][0], names)["state"]
        return {"state_dict": checkpoint["state_dict"], "optimizer": optimizer}

    reference = by_name(file)
    for name in KINDS:
        ckpt = last(kinds[name])
        if name != "file":
            assert main(["convert", str(ckpt), "--to", "single", str(tmp_path / f"{name}.ckpt")]) == 0
            single = read(tmp_path / f"{name}.ckpt")
            assert_same_training_state(by_name(single), reference, f"{name} -> single")
            assert single["global_step"] == file["global_step"] == STEPS
        if name != "fsdp":
            assert main(["convert", str(ckpt), "--to", "dcp", str(tmp_path / name)]) == 0
            shards = dcp.read(tmp_path / name)
            assert_same_training_state(shards, fsdp, f"{name} -> dcp")
            assert read(tmp_path / name / "meta.pt")["global_step"] == STEPS
    consolidated = consolidate(last(kinds["fsdp"]), tmp_path / "consolidated.ckpt")
    assert (tmp_path / "fsdp.ckpt").read_bytes() == consolidated.read_bytes()
    deepspeeds = read(consolidate(last(kinds["deepspeed"]), tmp_path / "lightning.ckpt"))["state_dict"]
    ours = read(tmp_path / "deepspeed.ckpt")[
        "state_dict"
    ]  # ds_to_universal's weights = Lightning's converter's
    assert ours.keys() == deepspeeds.keys() and all(torch.equal(ours[k], deepspeeds[k]) for k in ours)
    assert main(["convert", str(last(kinds["fsdp"])), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert main(["export", str(last(kinds["fsdp"])), str(tmp_path / "export")]) == 0
    converted, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "export"))
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k], exported[k]) for k in exported)
    capsys.readouterr()
    assert "is a single checkpoint already" in one_error_line(
        capsys, "convert", last(kinds["file"]), "--to", "single", tmp_path / "again.ckpt"
    )
    assert "is a dcp checkpoint already" in one_error_line(
        capsys, "convert", last(kinds["fsdp"]), "--to", "dcp", tmp_path / "again"
    )
    assert "exists; convert into a new path" in one_error_line(
        capsys, "convert", last(kinds["fsdp"]), "--to", "single", tmp_path / "fsdp.ckpt"
    )


def logged_val_loss(recipe: Path) -> float:
    return metric_by_step(read_metrics(recipe.parent / "run"), "val/loss")[STEPS]


def printed(out: str, key: str) -> float:
    return float(next(line.split(":")[1] for line in out.splitlines() if line.strip().startswith(key)))


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_validate_under_its_own_strategy(kinds, name):
    proc = run_cli("validate", str(kinds[name]), "--ckpt", str(last(kinds[name])), *KINDS[name][:2])
    assert printed(proc.stdout, "val/loss") == pytest.approx(logged_val_loss(kinds[name]), rel=1e-4)


@pytest.mark.slow
def test_validate_a_sharded_checkpoint_on_one_process(kinds, capsys):
    """A directory of another strategy is consolidated first: one process validates each kind to the same loss
    (its validation batches differ from the 2-rank run's, so the single file is the reference)."""
    losses = {}
    for name in KINDS:
        args = ["--ckpt", str(last(kinds[name])), "strategy.name=auto", "trainer.devices=1"]
        assert main(["validate", str(kinds[name]), *args]) == 0
        losses[name] = printed(capsys.readouterr().out, "val/loss")
    assert losses["fsdp"] == pytest.approx(losses["file"], rel=1e-4)
    assert losses["deepspeed"] == pytest.approx(losses["file"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_generate_and_export(kinds, name, tmp_path, capsys):
    import transformers

    ckpt = last(kinds[name])
    assert main(["generate", str(ckpt), "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "6"]) == 0
    assert "ROMEO:" in capsys.readouterr().out
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours, _, _ = load_model(ckpt)
    ids = torch.tensor([tok("ROMEO: what light")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_evaluate(kinds, name, tmp_path):
    items = [
        {"query": "ROMEO:", "choices": [" What", " zzz"], "gold": 0},
        {"query": "JULIET:", "choices": [" O", " qqq"], "gold": 0},
    ]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    task = tmp_path / "tiny.yaml"
    task.write_text(f"name: tiny\ntype: multiple_choice\npath: {tmp_path / 'tiny.jsonl'}\nnum_fewshot: 0\n")
    out = tmp_path / "results.json"
    args = ["evaluate", str(last(kinds[name])), "--tasks", str(task), "--device", "cpu", "--output", str(out)]
    assert main(args) == 0
    assert 0.0 <= json.loads(out.read_text())["results"]["tiny"]["metrics"]["acc"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_finetune_from_it(kinds, name, tmp_path, capsys):
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    for split, rows in (("train", lines[:64]), ("dev", lines[64:96])):
        body = "".join(f"{text.replace(chr(9), ' ')}\t{i % 2}\n" for i, text in enumerate(rows))
        (tmp_path / f"{split}.tsv").write_text("sentence\tlabel\n" + body)
    recipe = tmp_path / "ft.yaml"
    recipe.write_text(
        json.dumps(
            {
                "name": "ft",
                "run_dir": str(tmp_path / "run"),
                "init": {"checkpoint": str(last(kinds[name]))},
                "data": {
                    "task": "sst2",
                    "train_file": str(tmp_path / "train.tsv"),
                    "val_file": str(tmp_path / "dev.tsv"),
                    "micro_batch_size": 8,
                    "max_length": 64,  # the tiny backbone's positions
                },
                "save": False,
                "trainer": {
                    "max_steps": 2,
                    "accelerator": "cpu",
                    "val_check_interval": 2,
                    "progress_bar": False,
                },
            }
        )
    )
    assert main(["finetune", str(recipe)]) == 0
    assert "val/accuracy" in capsys.readouterr().out


@pytest.fixture(scope="module")
def resumed(kinds, tmp_path_factory):
    """Each kind's end-of-fit checkpoint extended to 8 steps under its own strategy (in a fresh run directory),
    and the FSDP one also from its consolidated single file, under FSDP and under DDP."""
    root = tmp_path_factory.mktemp("resumed")
    consolidated = consolidate(last(kinds["fsdp"]), root / "fsdp-consolidated.ckpt")
    launches = {name: (last(kinds[name]), KINDS[name][:2]) for name in KINDS}
    launches["fsdp-from-file"] = (consolidated, KINDS["fsdp"])
    launches["ddp-from-fsdp-file"] = (consolidated, KINDS["file"])
    launches["ddp-from-deepspeed"] = (last(kinds["deepspeed"]), KINDS["file"])  # via ds_to_universal
    runs = {}
    for name, (ckpt, strategy) in launches.items():
        overrides = [f"run_dir={root / name}", f"resume={ckpt}", "trainer.max_steps=8", *strategy]
        overrides.append(f"optim.decay_steps={STEPS}")  # the schedule the checkpoint was trained on
        runs[name] = Background("fit", str(kinds["file"]), *overrides, log=root / f"{name}.log")
    for run in runs.values():
        run.wait(timeout=900)
    return {name: metric_by_step(read_metrics(root / name), "train/loss") for name in launches}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["fsdp", "deepspeed", "fsdp-from-file", "ddp-from-fsdp-file", "ddp-from-deepspeed"]
)
def test_resume_continues_like_the_single_file_run(resumed, name):
    """Weights, optimizer moments, schedule and data position all come back: the continued losses equal those
    of the DDP run continued from its single file (a lost optimizer state or data position would part them)."""
    reference = resumed["file"]
    assert len(reference) == 2 and sorted(resumed[name]) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
