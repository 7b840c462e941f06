"""Bad input that used to slip through (issue 15): each case gives one clear line and exit status 2 before any
heavy work, or repairs the damage it used to take silently. The full-disk save is in ``test_guards.py``."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
import yaml
from training_utils import CORPUS, REPO_ROOT, one_error_line, tiny_recipe

from pretrain.cli import main
from pretrain.datamodules.prepare import prepare

GPT_TINY = REPO_ROOT / "recipes" / "gpt-tiny.yaml"
MODERNBERT = REPO_ROOT / "recipes" / "modernbert-tiny.yaml"


def pretrain(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def checkpoint(tiny_gpt_run):
    """A tiny GPT (learned positions, 64 of them) trained by `pretrain fit` (the session's)."""
    return tiny_gpt_run["ckpt"]


# ---------------------------------------------------------------------------------------- export
def test_export_into_a_non_empty_directory_keeps_the_users_files(capsys, tmp_path, checkpoint):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine")
    assert "is not empty" in one_error_line(capsys, "export", checkpoint, out)
    assert (out / "config.json").read_text() == "mine"
    # `pretrain convert --to hf` said "pass --force", an option it does not have (#32 sweep)
    line = one_error_line(capsys, "convert", "--to", "hf", checkpoint, out)
    assert (
        "convert into a new or empty directory" in line
        and f"pretrain export --force CHECKPOINT {out}" in line
    )
    status, stdout, _ = pretrain(capsys, "export", checkpoint, out, "--force")
    assert status == 0 and "exported" in stdout and (out / "model.safetensors").is_file()


def test_export_onto_a_file_is_an_error_not_a_success(capsys, tmp_path, checkpoint):
    target = tmp_path / "model.bin"
    target.write_text("mine")
    assert "is a file" in one_error_line(capsys, "export", checkpoint, target)
    assert target.read_text() == "mine"


def test_export_into_a_read_only_directory(capsys, tmp_path, checkpoint, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the file system's answer to anyone else, simulated

        def denied(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(out))

        monkeypatch.setattr("pretrain.finetuning.export.tempfile.TemporaryFile", denied)
    assert "Permission denied" in one_error_line(capsys, "export", checkpoint, out)


def test_an_export_removes_the_staging_directories_of_exports_killed_mid_write(capsys, tmp_path, checkpoint):
    """`pretrain export C hfk` killed with SIGKILL while writing (no clean-up runs) left `.hfk.partial-<hex>/`, a
    whole model's size, next to hfk; every killed attempt added one and no later export removed them. The next
    export (under hfk's lock, so no live writer owns one) now removes them. Found by the #32 sweep."""
    from pretrain.cli import main

    for name in (".hf.partial-6c4c2ab1", ".hf.partial-48538cf4"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half a model")
    (tmp_path / ".other.partial-00000000").mkdir()  # another output's: not ours to remove
    with pytest.warns(UserWarning, match="removed 2 staging directories of an interrupted export"):
        assert main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-00000000", "hf"]


def test_an_interrupted_export_leaves_no_half_written_directory(capsys, tmp_path, checkpoint, monkeypatch):
    """The disk fills while the tokenizer files are written (after config.json and the weights): the target
    directory is not created, nothing of the attempt is left, and a half-written directory made by hand (or by an
    older version) is refused by the readers in one line instead of being half-read."""

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "hf" / "tokenizer.json"))

    monkeypatch.setattr("pretrain.models.hf.hf_tokenizer", full_disk)
    assert "No space left on device" in one_error_line(capsys, "export", checkpoint, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no hf/, no .hf.partial-*
    monkeypatch.undo()

    from pretrain.errors import InputError
    from pretrain.evaluation.models import load_model_and_tokenizer

    assert pretrain(capsys, "export", checkpoint, tmp_path / "hf")[0] == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    with pytest.raises(InputError, match="not a complete transformers model directory.*model.safetensors"):
        load_model_and_tokenizer(tmp_path / "hf")


# ---------------------------------------------------------------------------------------- generate
def test_generate_num_samples_zero(capsys, checkpoint):
    assert "--num-samples must be >= 1" in one_error_line(capsys, "generate", checkpoint, "--num-samples", 0)


def test_generate_beyond_the_position_table_is_refused_before_generating(capsys, checkpoint):
    line = one_error_line(capsys, "generate", checkpoint, "--prompt", "ROMEO:", "--max-new-tokens", 200)
    assert "exceeds the model's 64 positions" in line and "--max-new-tokens" in line
    status, out, _ = pretrain(capsys, "generate", checkpoint, "--prompt", "ROMEO:", "--max-new-tokens", 8)
    assert status == 0 and "ROMEO:" in out


def test_generate_eos_not_in_the_vocabulary(capsys, checkpoint):
    assert "'<nope>' is not in the tokenizer's vocabulary" in one_error_line(
        capsys, "generate", checkpoint, "--eos", "<nope>"
    )


def test_unreadable_checkpoint_gives_no_unsafe_advice(capsys, tmp_path):
    hostile = tmp_path / "hostile.ckpt"
    torch.save({"state": shutil.copy}, hostile)  # unpickling it would import and reference shutil.copy
    line = one_error_line(capsys, "generate", hostile)
    assert "weights-only load refuses" in line and "weights_only=False" not in line
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    line = one_error_line(capsys, "generate", garbage)
    assert "unreadable" in line and "weights_only" not in line


# ---------------------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("limit", [-1, 0])
def test_evaluate_limit_below_one(capsys, tmp_path, limit):
    assert "limit (--limit) must be >= 1" in one_error_line(  # the flag named, as the recipe key
        capsys, "evaluate", tmp_path / "x.ckpt", "--tasks", "copa", "--limit", limit
    )


# ---------------------------------------------------------------------------------------- recipes
def test_malformed_recipe_yaml(capsys, tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("name: x\ntrainer: {max_steps: 10\nseed: 1\n")
    line = one_error_line(capsys, "fit", recipe)
    assert "invalid YAML" in line and "broken.yaml, line 3" in line


def test_objective_override_leaves_no_options_of_the_old_piece(capsys):
    bert = REPO_ROOT / "recipes" / "bert-tiny.yaml"
    line = one_error_line(capsys, "fit", bert, "objective.name=clm", "--print-config")
    assert (
        "['mask_replace_prob', 'mlm_probability', 'random_replace_prob']" in line
        and "~objective.options" in line
    )
    status, out, _ = pretrain(
        capsys, "fit", bert, "objective.name=clm", "~objective.options", "--print-config"
    )
    assert status == 0 and yaml.safe_load(out)["objective"] == {"name": "clm", "options": {}}


def test_the_old_clm_document_masking_option_names_its_replacement(capsys):
    line = one_error_line(
        capsys, "fit", GPT_TINY, "objective.options.document_masking=true", "--print-config"
    )
    assert "replaced by data.document_mask" in line


def test_a_run_dir_that_is_a_file_is_named_as_the_recipe_key(capsys, tmp_path):
    (tmp_path / "run").write_text("mine")  # before: "[Errno 17] File exists" after Lightning's import
    line = one_error_line(capsys, "fit", GPT_TINY, f"run_dir={tmp_path / 'run'}")
    assert f"run_dir={tmp_path / 'run'} is a file; give a directory" in line
    assert (tmp_path / "run").read_text() == "mine"


def test_negative_learning_rate_is_named_before_the_run_directory_exists(capsys, tmp_path):
    run_dir = tmp_path / "run"
    line = one_error_line(capsys, "fit", GPT_TINY, "optim.lr=-1", f"run_dir={run_dir}")
    assert "optim.lr must be a finite number > 0" in line and not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.position=rope", "model.rope_scaling={type: ntk, factor: 4}"],
            "rope_scaling.type must be one of",
        ),
        (["model.position=rope", "model.rope_scaling={type: yarn}"], "rope_scaling.factor is required"),
        (["model.rope_scaling={type: yarn, factor: 4}"], "rope_scaling scales rotary positions"),
        ([MODERNBERT, "data.seq_len=32"], "local_attention_window=33 is not smaller than data.seq_len=32"),
        (
            [MODERNBERT, "model.global_attn_every_n_layers=5"],
            "global_attn_every_n_layers must be an integer in [1, 4]",
        ),
        (
            [MODERNBERT, "model.local_attention_window=0"],
            "local_attention_window must be an integer in [1, 256]",
        ),
        (
            ["model.n_head=3"],
            "divisible by model.n_head (3), or set model.head_dim",
        ),  # before: n_head, head_dim
    ],
    ids=[
        "unknown-rope-type",
        "missing-factor",
        "no-rope",
        "window-over-context",
        "pattern",
        "local-no-window",
        "heads-not-dividing-width",
    ],
)
def test_bad_model_section_is_one_line_before_the_run_directory_exists(capsys, tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    recipe, overrides = (overrides[0], overrides[1:]) if overrides[0] == MODERNBERT else (GPT_TINY, overrides)
    line = one_error_line(capsys, "fit", recipe, *overrides, f"run_dir={run_dir}")
    assert expected in line and "model" in line and not run_dir.exists()


# ---------------------------------------------------------------------------------------- tokenizer / prepare
def test_truncated_tokenizer_is_not_reused(capsys, tmp_path, tiny_world):
    tokenizer = tmp_path / "tokenizer.json"
    text = tiny_world["tokenizer"].read_text()
    tokenizer.write_text(text[: len(text) // 2])
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", tokenizer={"path": str(tokenizer)})
    assert "--force" in one_error_line(capsys, "tokenizer", recipe)


def test_invalid_utf8_hint_names_the_recipe_key(capsys, tmp_path, tiny_world):
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(CORPUS.read_bytes()[:20_000] + b"\nbad \xff byte\n\n" + CORPUS.read_bytes()[:20_000])
    data = {"sources": [{"name": "bad", "text": [str(corpus)], "prepared": str(tmp_path / "prepared")}]}
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data=data)
    line = one_error_line(capsys, "prepare", recipe)
    assert "bad.txt:" in line and "data.on_invalid_utf8=replace" in line
    status, _, _ = pretrain(capsys, "prepare", recipe, "data.on_invalid_utf8=replace")
    assert status == 0


def test_a_missing_corpus_input_names_the_recipe_key_that_lists_it(capsys, tmp_path, tiny_world):
    """prepare and tokenizer said "corpus input 'nope.txt' does not exist" without the key that listed it."""
    data = {
        "sources": [{"name": "web", "text": [str(tmp_path / "nope.txt")], "prepared": str(tmp_path / "p")}]
    }
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data=data)
    line = one_error_line(capsys, "prepare", recipe)
    assert "data.sources[0].text (source 'web'): corpus input" in line and "nope.txt' does not exist" in line
    tokenizer = {"path": str(tmp_path / "t.json"), "train_files": [str(tmp_path / "nope*.txt")]}
    line = one_error_line(capsys, "tokenizer", tiny_recipe(tmp_path, tiny_world, "gpt", tokenizer=tokenizer))
    assert "tokenizer.train_files: the pattern" in line and "matches no files" in line


def test_empty_validation_hint_names_the_recipe_key(tmp_path, tiny_world):
    from pretrain.datamodules.pretrain import PretrainDataModule
    from pretrain.objectives import build

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:20_000])
    prepare([corpus], tiny_world["tokenizer"], tmp_path / "data", val_fraction=0.0, progress=False)
    from pretrain.datamodules.tokenizer import load_tokenizer

    objective = build("clm", load_tokenizer(tiny_world["tokenizer"]))
    data = PretrainDataModule(tmp_path / "data", objective, seq_len=32, micro_batch_size=2, val_batches=2)
    with pytest.raises(ValueError, match="trainer.limit_val_batches=0"):
        data.setup("fit")


def test_truncated_train_bin_is_rebuilt_not_a_cache_hit(tmp_path, tiny_world):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:20_000])
    out = tmp_path / "data"
    first = prepare([corpus], tiny_world["tokenizer"], out, val_fraction=0.1, progress=False)
    size = (out / "train.bin").stat().st_size
    with open(out / "train.bin", "r+b") as f:
        f.truncate(size - 20)  # a whole number of tokens: the sizes alone look plausible
    with pytest.warns(UserWarning, match="damaged"):
        again = prepare([corpus], tiny_world["tokenizer"], out, val_fraction=0.1, progress=False)
    assert not again["cache_hit"] and (out / "train.bin").stat().st_size == size
    assert again["splits"] == first["splits"]


def test_prepare_removes_what_killed_runs_left(tmp_path, tiny_world):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS.read_text()[:5_000])
    leftovers = [tmp_path / ".data.tmp-0badf00d", tmp_path / ".data.old-0badf00d"]
    for leftover in leftovers:
        leftover.mkdir()
        (leftover / "train.bin").write_bytes(b"\0" * 100)
    prepare([corpus], tiny_world["tokenizer"], tmp_path / "data", val_fraction=0.1, progress=False)
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "data"]


def test_prepared_only_source_of_an_older_format_is_refused(capsys, tmp_path, tiny_world):
    """A corpus written before special-token text was encoded as text, named by ``prepared`` alone (no raw text to
    compare with): its format version tells, before any heavy work."""
    import json

    data = tmp_path / "data"
    shutil.copytree(tiny_world["data"], data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "format_version": 2}))
    recipe = tiny_recipe(
        tmp_path, tiny_world, "gpt", data={"sources": [{"name": "old", "prepared": str(data)}]}
    )
    line = one_error_line(capsys, "fit", recipe)
    assert "is stale" in line and "format version 2" in line and "special-token strings" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- document masks
def test_document_mask_on_a_corpus_without_document_lengths(capsys, tmp_path, tiny_world):
    import json

    data = tmp_path / "data"
    shutil.copytree(tiny_world["data"], data)
    meta = json.loads((data / "meta.json").read_text())
    del meta["document_lengths"]  # as another tool would write it
    (data / "meta.json").write_text(json.dumps(meta))
    recipe = tiny_recipe(
        tmp_path, tiny_world, "gpt", data={"sources": [{"name": "x", "prepared": str(data)}]}
    )
    line = one_error_line(capsys, "fit", recipe, "data.document_mask=true")
    assert "records none" in line and "data.document_mask=false" in line and not (tmp_path / "run").exists()


def test_a_window_larger_than_the_context(capsys):
    line = one_error_line(capsys, "fit", GPT_TINY, "model.attention_window=128", "--print-config")
    assert "model.attention_window=128 is not smaller than data.seq_len=128" in line


def test_document_mask_with_a_baseline_that_reads_across_documents(capsys):
    line = one_error_line(
        capsys, "baseline", REPO_ROOT / "recipes" / "lstm-lm-tiny.yaml", "data.document_mask=true"
    )
    assert "baseline rnn_lm cannot honour data.document_mask" in line and "data.document_mask=false" in line
