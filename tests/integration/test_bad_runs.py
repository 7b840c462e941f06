"""Runs that used to end in a wrong or misleading result (issue 22): a run shorter than the log interval, a
finished run fitted again, a baseline run that ignored ``resume``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from training_utils import metric_by_step, read_metrics, tiny_recipe

from pretrain.cli import main


def test_a_run_shorter_than_the_log_interval_logs_and_plots(capfd, tmp_path, tiny_world):
    trainer = {"max_steps": 3, "log_every_n_steps": 10, "val_check_interval": 100, "progress_bar": True}
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer=trainer, logger={"curves": True})
    assert main(["fit", str(recipe)]) == 0
    out, err = capfd.readouterr()
    # not a terminal: progress as plain lines (the last step's at least), and no library tips or notices
    assert re.search(r"^step 3/3 \(100%\) \| loss \d+\.\d{4} \| \d+m\d\ds elapsed$", out, re.MULTILINE), out
    assert (
        "Tip:" not in err + out and "weights_only` was not set" not in err + out and "Epoch" not in err + out
    )
    csv_file = tmp_path / "run" / "logs" / "version_0" / "metrics.csv"
    assert f"metrics CSV: {csv_file}" in out and csv_file.is_file()
    assert [int(r["step"]) for r in read_metrics(tmp_path / "run") if r.get("train/loss")] == [3]
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(b"\x89PNG")

    # fitted again, the finished run says so and how to go on, instead of silently training 0 steps
    assert main(["fit", str(recipe)]) == 0
    out = capfd.readouterr().out
    assert "nothing to train" in out and "already reached trainer.max_steps=3" in out and "name=NEW" in out
    assert not (tmp_path / "run" / "logs" / "version_1").exists()  # no Trainer was built


@pytest.mark.slow
def test_baseline_resumes_instead_of_overwriting_the_previous_run(capsys, tmp_path, tiny_world):
    run_dir = tmp_path / "lstm"
    common = [
        f"run_dir={run_dir}",
        f"tokenizer.path={tiny_world['tokenizer']}",
        f"data.sources.0.text=[{tiny_world['corpus']}]",  # as the fixture prepared it: reused, not rebuilt
        f"data.sources.0.prepared={tiny_world['data']}",
        "data.val_fraction=0.1",
        "baselines.model.vocab_size=512",
        "baselines.model.d_embed=16",
        "baselines.model.d_hidden=16",
        "data.micro_batch_size=2",
        "data.seq_len=16",
        "trainer.val_check_interval=100",
        "trainer.limit_val_batches=0",  # no validation stream (nor its final perplexity pass)
        "trainer.log_every_n_steps=1",
        "trainer.progress_bar=false",
        "logger.wandb.enabled=false",
        "checkpoint.every_n_steps=1",
        "optim.decay_steps=4",  # one schedule for both launches (a resume compares it, as pretrain fit does)
    ]
    assert main(["baseline", "recipes/lstm-lm-tiny.yaml", *common, "trainer.max_steps=2"]) == 0
    assert main(["baseline", "recipes/lstm-lm-tiny.yaml", *common, "trainer.max_steps=4"]) == 0
    second = read_metrics(run_dir, newest_only=True)
    assert sorted({int(r["step"]) for r in second if r.get("train/loss")}) == [3, 4]  # steps 3 and 4 only
    line = "pretrain baseline: error: checkpoint"
    assert main(["baseline", "recipes/lstm-lm-tiny.yaml", *common, "baselines.model.d_hidden=8"]) == 2
    assert line in capsys.readouterr().err  # another model's checkpoint: refused in one line


def test_resume_on_other_data_or_tokenizer_is_refused(capsys, tmp_path, tiny_world):
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import train_bpe

    def fit(data, tokenizer=tiny_world["tokenizer"], *overrides: str) -> int:
        recipe = tiny_recipe(
            tmp_path,
            tiny_world,
            "gpt",
            trainer={"max_steps": 4, "val_check_interval": 100},
            optim={"decay_steps": 6},  # one learning-rate schedule for every launch
            tokenizer={"path": str(tokenizer)},
            data={"sources": [{"name": "tiny", "prepared": str(data)}], "seq_len": 32, "micro_batch_size": 4},
        )
        return main(["fit", str(recipe), *overrides])

    assert fit(tiny_world["data"], tiny_world["tokenizer"], "trainer.max_steps=2") == 0
    # the corpus edited (two paragraphs swapped: the same samples per epoch, which is all that was checked)
    text = tiny_world["corpus"].read_text().split("\n\n")
    base = prepare(
        [tiny_world["corpus"]], tiny_world["tokenizer"], tmp_path / "same", val_fraction=0.1, progress=False
    )
    for i in range(0, 20, 2):
        edited = tmp_path / "edited.txt"
        edited.write_text("\n\n".join([*text[:i], text[i + 1], text[i], *text[i + 2 :]]))
        meta = prepare(
            [edited], tiny_world["tokenizer"], tmp_path / f"edited{i}", val_fraction=0.1, progress=False
        )
        if meta["splits"] == base["splits"]:
            break
    capsys.readouterr()
    assert fit(tmp_path / f"edited{i}") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "prepared data (corpus keys).tiny: checkpoint '" in err
    assert "resume_allow=[data]" in err
    assert (
        fit(tmp_path / f"edited{i}", tiny_world["tokenizer"], "resume_allow=[data]") == 0
    )  # the explicit override

    # another tokenizer of the same vocabulary size, and the corpus prepared with it
    other, backwards = tmp_path / "other-tokenizer.json", tmp_path / "backwards.txt"
    backwards.write_text("\n".join(line[::-1] for line in edited.read_text().splitlines()))
    train_bpe([backwards], 512, other, min_frequency=2, show_progress=False)
    prepare([edited], other, tmp_path / "other", val_fraction=0.1, progress=False)  # the checkpoint's corpus
    capsys.readouterr()
    assert fit(tmp_path / "other", other, "trainer.max_steps=6") == 2
    assert "tokenizer (sha256 of tokenizer.json): checkpoint '" in capsys.readouterr().err


def test_last_checkpoint_holds_its_steps_validation_and_resume_keeps_top_k(tmp_path, tiny_world):
    from pretrain.checkpoint import read

    def best_state(path):
        (state,) = [v for k, v in read(path)["callbacks"].items() if k.startswith("ModelCheckpoint")]
        return state

    trainer = {"max_steps": 4, "val_check_interval": 2}
    checkpoint = {"every_n_steps": 2, "save_top_k": 1, "monitor": "val/accuracy"}  # higher is better
    optim = {"decay_steps": 8}  # the schedule of the extended run from the start
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer=trainer, checkpoint=checkpoint, optim=optim)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert main(["fit", str(recipe)]) == 0
    state = best_state(checkpoints / "last.ckpt")  # saved after step 4's validation: it knows that result
    assert state["best_model_path"] and Path(state["best_model_path"]).is_file()
    assert {Path(p).name for p in state["best_k_models"]} == {p.name for p in checkpoints.glob("best-*.ckpt")}

    assert (
        main(["fit", str(recipe), "trainer.max_steps=8"]) == 0
    )  # resumed: the tracker still names real files
    best = sorted(checkpoints.glob("best-*.ckpt"))
    state = best_state(checkpoints / "last.ckpt")
    assert len(best) == 1 and Path(state["best_model_path"]) == best[0]
    # the one kept is the most accurate (checkpoint.mode from the metric's name; mode=min kept the least)
    accuracy = metric_by_step(read_metrics(tmp_path / "run"), "val/accuracy")
    assert len(set(accuracy.values())) > 1, accuracy  # the ranking decides something
    step = int(re.match(r"best-step(\d+)-accuracy", best[0].name)[1])
    assert accuracy[step] == max(accuracy.values()), (best[0].name, accuracy)  # one step numbering


def test_save_top_k_minus_one_keeps_every_validations_checkpoint(tmp_path, tiny_world):
    """As Lightning's ``save_top_k=-1``: no ranking, one best-* file per validation."""
    trainer = {"max_steps": 6, "val_check_interval": 2}
    checkpoint = {"every_n_steps": 2, "save_top_k": -1}
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer=trainer, checkpoint=checkpoint)
    assert main(["fit", str(recipe)]) == 0
    kept = sorted(
        int(re.match(r"best-step(\d+)-", p.name)[1])
        for p in (tmp_path / "run" / "checkpoints").glob("best-*")
    )
    assert kept == [2, 4, 6]
