"""The `pretrain` CLI: every subcommand end to end on tiny data, and bad input stopped before training."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import torch
from training_utils import REPO_ROOT, cli_env, tiny_recipe

from pretrain.checkpoint import PAYLOAD, read
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.cli import COMMANDS, main
from pretrain.models.config import ModelConfig


def pretrain(capsys, *args: str) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def trained(tiny_gpt_run):
    """A tiny GPT trained for 4 steps through `pretrain fit` (in process; the session's)."""
    return tiny_gpt_run


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: pretrain " + command in capsys.readouterr().out


def test_console_script():
    script = shutil.which("pretrain")
    assert script is not None, (
        "the console script is missing: `make install` installs the package (pip install -e .)"
    )
    out = subprocess.run([script, "--help"], capture_output=True, text=True, env=cli_env(), check=True).stdout
    assert all(name in out for name in COMMANDS)


def test_tokenizer_and_prepare(tmp_path, capsys, tiny_world):
    recipe = tiny_recipe(
        tmp_path,
        tiny_world,
        "gpt",
        tokenizer={
            "path": str(tmp_path / "tok.json"),
            "train_files": [str(tiny_world["corpus"])],
            "vocab_size": 400,
        },
        data={
            "sources": [
                {"name": "c", "text": [str(tiny_world["corpus"])], "prepared": str(tmp_path / "prepared")}
            ],
            "val_fraction": 0.1,
        },
    )
    status, out, _ = pretrain(capsys, "tokenizer", recipe)
    assert status == 0 and "trained a byte-level BPE of 400 tokens" in out
    status, out, _ = pretrain(capsys, "tokenizer", recipe)
    assert status == 0 and "reusing it" in out
    # before: "reusing it", exit 0, the 400-token tokenizer for one of 300 asked (#32 sweep)
    status, _, err = pretrain(capsys, "tokenizer", recipe, "tokenizer.vocab_size=300")
    assert status == 2 and "exists with 400 tokens, more than tokenizer.vocab_size=300" in err
    status, out, _ = pretrain(capsys, "prepare", recipe)
    assert status == 0 and "prepared c ->" in out and "val" in out
    assert (tmp_path / "prepared" / "train.bin").is_file()


def test_fit_writes_a_self_contained_checkpoint(trained, tiny_world):
    ckpt = read(trained["ckpt"])
    assert ckpt["global_step"] == 4
    info = ckpt[PAYLOAD]
    assert info["config"]["model"]["arch"] == "decoder" and info["config"]["trainer"]["max_steps"] == 4
    assert json.loads(info["tokenizer_json"]) == json.loads(tiny_world["tokenizer"].read_text())
    assert len(info["wandb_run_id"]) == 8 and info["tokens_seen"] == 4 * 4 * 32
    assert ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    assert ckpt["PretrainData"]["consumed_samples"] == 16  # the data position
    assert (trained["dir"] / "run" / "logs" / "version_0" / "hparams.yaml").is_file()
    assert (trained["dir"] / "run" / "curves.png").read_bytes().startswith(b"\x89PNG")  # offline curves


def test_fit_again_resumes_and_has_nothing_left_to_do(trained, capsys):
    status, out, _ = pretrain(capsys, "fit", trained["recipe"])
    assert status == 0 and "steps: 4" in out


def test_print_config(trained, capsys):
    status, out, _ = pretrain(capsys, "fit", trained["recipe"], "--print-config", "optim.lr=0.5")
    assert status == 0 and "lr: 0.5" in out and "arch: decoder" in out


def test_validate(trained, capsys):
    status, out, _ = pretrain(capsys, "validate", trained["recipe"])
    assert status == 0 and "val/loss:" in out and "last.ckpt" in out
    # the recipe as written (another step count, hence learning-rate horizon, and optimizer): weights validate alike
    status, again, err = pretrain(
        capsys, "validate", trained["recipe"], "trainer.max_steps=1000", "optim.name=muon", "optim.lr=0.5"
    )
    assert status == 0, err
    assert [line for line in again.splitlines() if "val/loss:" in line] == [
        line for line in out.splitlines() if "val/loss:" in line
    ]


def test_generate(trained, capsys):
    status, out, _ = pretrain(
        capsys, "generate", trained["ckpt"], "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "8"
    )
    assert status == 0 and out.count("--- sample") == 1 and "ROMEO:" in out
    status, again, _ = pretrain(
        capsys, "generate", trained["ckpt"], "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "8"
    )
    assert again == out  # greedy is deterministic
    args = [
        "generate",
        trained["ckpt"],
        "--prompt",
        "To be",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--temperature",
        "1.2",
        "--num-samples",
        "2",
        "--seed",
        "3",
        "--max-new-tokens",
        "8",
    ]
    status, sampled, _ = pretrain(capsys, *args)
    assert status == 0 and sampled.count("--- sample") == 2
    assert pretrain(capsys, *args)[1] == sampled  # the seed makes sampling reproducible


def test_export_loads_in_transformers(trained, tmp_path, capsys):
    import transformers

    status, out, _ = pretrain(capsys, "export", trained["ckpt"], tmp_path / "hf")
    assert status == 0 and "exported" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    from pretrain.checkpoint import load_model

    ours, _, _ = load_model(trained["ckpt"])
    ids = torch.tensor([tok("ROMEO: what light")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_step=3"], "unknown config key 'max_step' at trainer.max_step; did you mean max_steps"),
        (["trainer.max_steps=many"], "trainer.max_steps: expected int, got str 'many'"),
        (["objective.name=mlm"], "objective 'mlm' needs a model with arch in ['encoder']"),
        (
            ["objective.name=span_corruption", "model.arch=encoder"],
            "needs a model with arch in ['encoder-decoder']",
        ),
        (["tokenizer.path=/nonexistent/tok.json"], "tokenizer /nonexistent/tok.json not found"),
        (["data.sources.0.prepared=/nonexistent/data"], "/nonexistent/data is not a prepared corpus"),
        (["model.vocab_size=128"], "set model.vocab_size >= 512"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, capsys, tiny_world, overrides, message):
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt")
    status, _, err = pretrain(capsys, "fit", recipe, *overrides)
    assert status == 2 and message in err
    assert not (tmp_path / "run").exists()  # nothing ran


def test_checkpoint_of_another_architecture_is_refused(tmp_path, capsys, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt")
    bert = dataclasses.asdict(ModelConfig(arch="encoder", vocab_size=512, d_model=32, n_layer=2, n_head=2))
    AtomicCheckpointIO().save_checkpoint(
        {"global_step": 3, "state_dict": {}, "optimizer_states": [], PAYLOAD: {"config": {"model": bert}}},
        tmp_path / "bert.ckpt",
    )
    status, _, err = pretrain(capsys, "fit", recipe, f"resume={tmp_path / 'bert.ckpt'}")
    assert (
        status == 2 and "holds a different model (model.arch: checkpoint 'encoder' vs config 'decoder'" in err
    )
    assert not (tmp_path / "run").exists()


def test_resume_under_other_run_time_settings(trained, tmp_path):
    """Run-time settings are not the model: the checkpoint resumes with another attention backend and compile (the
    module is built with them), and trains on with dropout and activation checkpointing."""
    from pretrain import config
    from pretrain.training.setup import prepare_run

    resume = [f"resume={trained['ckpt']}", f"run_dir={tmp_path}"]
    run, resolved = config.load(trained["recipe"], [*resume, "model.attention=flex", "trainer.compile=true"])
    model = prepare_run(run, resolved).module.model
    assert model.config.attention == "flex" and hasattr(model, "_compiled_call_impl")
    assert (
        main(
            [
                "fit",
                str(trained["recipe"]),
                *resume,
                "trainer.max_steps=5",
                "optim.decay_steps=4",  # the checkpoint's learning-rate schedule (it decayed over 4 steps)
                "model.dropout=0.1",
                "trainer.activation_checkpointing=true",
            ]
        )
        == 0
    )
    assert read(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 5


def test_data_prepared_with_another_tokenizer_is_refused(tmp_path, capsys, tiny_world):
    from pretrain.datamodules.tokenizer import train_bpe

    other = tmp_path / "other.json"
    train_bpe([tiny_world["corpus"]], 450, other, show_progress=False)
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", tokenizer={"path": str(other)})
    status, _, err = pretrain(capsys, "fit", recipe)
    assert status == 2 and "was prepared with another tokenizer" in err


def test_generate_needs_a_decoder(tmp_path, capsys, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, "bert", trainer={"max_steps": 1}, checkpoint={"save_top_k": 0})
    assert main(["fit", str(recipe)]) == 0
    capsys.readouterr()
    status, _, err = pretrain(capsys, "generate", tmp_path / "run/checkpoints/last.ckpt", "--prompt", "x")
    assert (
        status == 2 and "generate needs arch 'decoder' or 'encoder-decoder'" in err and "Traceback" not in err
    )


def test_generate_encoder_decoder(tmp_path, capsys, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, "t5", trainer={"max_steps": 1}, checkpoint={"save_top_k": 0})
    assert main(["fit", str(recipe)]) == 0
    capsys.readouterr()
    status, out, _ = pretrain(
        capsys,
        "generate",
        tmp_path / "run/checkpoints/last.ckpt",
        "--prompt",
        "To be or <extra_id_0> to be",
        "--greedy",
        "--max-new-tokens",
        "5",
    )
    assert status == 0 and "--- sample 0 ---" in out


@pytest.mark.parametrize("command", ["finetune", "baseline", "fit", "tokenizer", "prepare"])
def test_later_stages_report_bad_input_through_the_cli(command, capsys):
    assert main([command, "recipes/does-not-exist.yaml"]) == 2
    assert f"pretrain {command}: error:" in capsys.readouterr().err


def test_missing_recipe(capsys):
    status, _, err = pretrain(capsys, "fit", REPO_ROOT / "recipes" / "nope.yaml")
    assert status == 2 and "ready recipes" in err


def test_no_library_module_imports_a_cli_module():
    """Layers point one way: a verb's module ``pretrain/cli/<verb>.py`` is reached only through the dispatcher
    (``pretrain/cli/__init__.py``) and imports no other verb (shared argument helpers: ``pretrain.cli.common``);
    library modules import no CLI module at all, and benchmarks drive the CLI only as users do (``pretrain.cli``'s
    ``main``)."""
    import ast

    offenders = []
    for root in ("pretrain", "objectives", "datamodules", "benchmarks"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            where = path.relative_to(REPO_ROOT).as_posix()
            if where in ("pretrain/cli/__init__.py", "pretrain/__main__.py") or not path.is_file():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                for name in names:
                    if name.split(".")[:2] != ["pretrain", "cli"]:
                        continue
                    verb = name.split(".")[2] if len(name.split(".")) > 2 else None
                    if where.startswith("pretrain/cli/"):
                        ok = verb in ("common", None) and name != "pretrain.cli.main"
                    else:
                        ok = root == "benchmarks" and name in ("pretrain.cli", "pretrain.cli.main")
                    if not ok:
                        offenders.append(f"{where}: {name}")
    assert not offenders, offenders
    assert {p.stem for p in (REPO_ROOT / "pretrain" / "cli").glob("*.py")} == {
        *COMMANDS,
        "__init__",
        "common",
    }


def test_a_branch_from_another_runs_checkpoint_logs_to_its_own_wandb_run(trained, tmp_path):
    """`pretrain fit gpt-tiny name=branch resume=runs/base/checkpoints/last.ckpt` continued base's W&B run id:
    synced, base's W&B run held branch's steps, and base's own later steps were dropped (W&B cannot rewind). A
    checkpoint of another run directory now starts a W&B run of its own; one of this directory continues its
    run. Found by the #32 sweep."""
    from pretrain import config
    from pretrain.training.setup import prepare_run

    saved = read(trained["ckpt"])[PAYLOAD]["wandb_run_id"]
    run, resolved = config.load(trained["recipe"], [f"resume={trained['ckpt']}", f"run_dir={tmp_path}"])
    with pytest.warns(UserWarning, match="checkpoint of another run directory.*W&B run of its own"):
        branch = prepare_run(run, resolved).module.wandb_id
    assert branch and branch != saved
    own_dir = trained["ckpt"].parent.parent  # the run's own directory: its W&B run continues
    run, resolved = config.load(trained["recipe"], [f"resume={trained['ckpt']}", f"run_dir={own_dir}"])
    assert prepare_run(run, resolved).module.wandb_id == saved
