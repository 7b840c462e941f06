"""A resume compares what gives the restored state its meaning (``FIT_RESUME``): a difference is refused in one line
naming every key with both values, or applied as ``resume_allow`` says -- the optimizer re-initialised (also from
AdamW to Muon), the learning rate following the new schedule from the checkpoint's step. The resumed runs start
from a copy of the shared 4-step ``tiny_gpt_run`` (AdamW, cosine over 4 steps)."""

from __future__ import annotations

import shutil

import pytest
from training_utils import REPO_ROOT, metric_by_step, one_error_line, read_metrics

from pretrain import config
from pretrain.checkpoint import read
from pretrain.cli import main
from pretrain.optim import lr_lambda


@pytest.fixture
def run_dir(tmp_path, tiny_gpt_run):
    """A copy of the trained run (its checkpoints), resumed with ``run_dir=...``."""
    shutil.copytree(tiny_gpt_run["dir"] / "run" / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run"


def fit(tiny_gpt_run, run_dir, *overrides: str) -> int:
    return main(["fit", str(tiny_gpt_run["recipe"]), f"run_dir={run_dir}", *overrides])


def test_another_optimizer_is_refused_or_reinitialised(capsys, tiny_gpt_run, run_dir):
    line = one_error_line(capsys, "fit", tiny_gpt_run["recipe"], f"run_dir={run_dir}", "optim.name=muon")
    assert "optim.name: checkpoint 'adamw' vs config 'muon'" in line and "resume_allow=[optimizer]" in line
    # allowed: Muon's groups from a fresh state (before: AdamW's saved decay/no_decay groups were loaded instead)
    longer = ["trainer.max_steps=6", "optim.decay_steps=4"]
    with pytest.warns(UserWarning, match="optimizer state re-initialised"):
        assert fit(tiny_gpt_run, run_dir, "optim.name=muon", "resume_allow=[optimizer]", *longer) == 0
    saved = read(run_dir / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 6
    (state,) = saved["optimizer_states"]
    muon = next(g for g in state["param_groups"] if g["name"] == "muon")
    assert muon["params"] and all(set(state["state"][i]) == {"momentum_buffer"} for i in muon["params"])
    # and back: a Muon checkpoint resumed with AdamW is one line (before: a 65-line KeyError: 'step')
    line = one_error_line(capsys, "fit", tiny_gpt_run["recipe"], f"run_dir={run_dir}", "trainer.max_steps=8")
    assert "optim.name: checkpoint 'muon' vs config 'adamw'" in line


def test_another_learning_rate_schedule_is_refused_or_followed(capsys, tiny_gpt_run, run_dir):
    # raising max_steps stretches a schedule that decays over it: the learning rate would jump back up
    line = one_error_line(capsys, "fit", tiny_gpt_run["recipe"], f"run_dir={run_dir}", "trainer.max_steps=6")
    assert "optim.decay_steps (default trainer.max_steps): checkpoint 4 vs config 6" in line
    assert "resume_allow=[lr_schedule]" in line
    overrides = ["trainer.max_steps=6", "optim.decay_steps=4", "optim.lr=0.01"]
    line = one_error_line(capsys, "fit", tiny_gpt_run["recipe"], f"run_dir={run_dir}", *overrides)
    assert "optim.lr: checkpoint 0.002 vs config 0.01" in line
    with pytest.warns(UserWarning, match="follows the new schedule"):
        assert fit(tiny_gpt_run, run_dir, *overrides, "resume_allow=[lr_schedule]") == 0
    run, _ = config.load(tiny_gpt_run["recipe"], overrides)
    rate = lr_lambda(run.optim, 6)
    logged = metric_by_step(read_metrics(run_dir, newest_only=True), "train/lr")
    assert logged == pytest.approx({5: 0.01 * rate(4), 6: 0.01 * rate(5)})  # before: 0.002 x the factor
    groups = read(run_dir / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([0.01 * rate(6)] * len(groups))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["objective.name=prefix_lm", "objective.options={arch: decoder}"],
            ["objective.name: checkpoint 'clm' vs config 'prefix_lm'", "resume_allow=[objective]"],
        ),
        (["seed=8"], ["seed: checkpoint 7 vs config 8", "`seed` cannot change within a run"]),
        (  # every difference in one line
            ["optim.name=muon", "optim.weight_decay=0", "optim.warmup_steps=3"],
            [
                "optim.name: checkpoint 'adamw' vs config 'muon'",
                "optim.weight_decay: checkpoint 0.1 vs config 0",
                "optim.warmup_steps: checkpoint 2 vs config 3",
                "resume_allow=[lr_schedule,optimizer]",
            ],
        ),
    ],
)
def test_other_settings_are_refused_in_one_line(capsys, tiny_gpt_run, run_dir, overrides, expected):
    line = one_error_line(capsys, "fit", tiny_gpt_run["recipe"], f"run_dir={run_dir}", *overrides)
    assert all(part in line for part in expected), line


def test_the_docs_table_lists_every_comparison():
    from pretrain.finetuning.checkpoint import FINETUNE_RESUME
    from pretrain.training.setup import FIT_RESUME

    text = (REPO_ROOT / "docs" / "resume.md").read_text()
    fit, finetune = text.split("## `pretrain finetune`")
    for section, table in ((fit, FIT_RESUME), (finetune, FINETUNE_RESUME)):
        for entry in table:
            allow = f"`{entry.allow}`" if entry.allow else "never"
            assert f"| {entry.what} | {allow} | {entry.means} |" in section, entry.what
