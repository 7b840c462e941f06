"""``trainer.sync_check=error``: a step that does not log reads nothing back from the device, for every family x
objective, in one process (CPU counting mode) and under DDP and FSDP (2 gloo ranks), through the real Trainer with
the project's callbacks (guards, hang watchdog, throughput monitor, checkpoints, CSV logger, progress bar); and a
host read in a user callback stops the run, naming the op and its file:line."""

from __future__ import annotations

import inspect
import random
import subprocess

import pytest
from lightning.pytorch.callbacks import Callback
from training_utils import REPO_ROOT, TINY_MODEL, cli_command, cli_env, tiny_recipe

from pretrain import config
from pretrain.training.callbacks.host_sync import HostSyncError, SyncCheck
from pretrain.training.setup import prepare_run
from pretrain.training.trainer import build_trainer

# 4 steps, logging on step 2 only: steps 0, 1 and 3 are checked
TRAINER = {"max_steps": 4, "log_every_n_steps": 3, "val_check_interval": 4, "progress_bar": True}
OBJECTIVES = {
    "clm": ("gpt", {}),
    "prefix_lm": ("gpt", {"arch": "decoder"}),
    "mlm": ("bert", {}),
    "span_corruption": ("t5", {}),
    "ul2": ("t5", {"input_length": 32}),
}


def recipe(tmp_path, world, objective: str, **trainer):
    kind, options = OBJECTIVES[objective]
    return tiny_recipe(
        tmp_path,
        world,
        kind,
        objective={"name": objective, "options": options},
        trainer={**TRAINER, "sync_check": "error", **trainer},
        checkpoint={"every_n_steps": 2, "save_top_k": 0},  # a save inside a checked step
    )


def fit(path, callbacks=(), overrides=()) -> SyncCheck:
    run, resolved = config.load(path, list(overrides))
    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved, callbacks=list(callbacks))
    trainer.fit(parts.module, datamodule=parts.datamodule)
    return next(cb for cb in trainer.callbacks if isinstance(cb, SyncCheck))


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_steps_that_do_not_log_read_nothing_from_the_device(tmp_path, tiny_world, objective):
    check = fit(recipe(tmp_path, tiny_world, objective))
    assert check.checked_steps == 3 and not check.counts


def test_muon_steps_read_nothing_from_the_device(tmp_path, tiny_world):
    """Muon's non-finite verdict is a select on the device (before: the guard read it on the host every step)."""
    path = recipe(tmp_path, tiny_world, "clm")
    check = fit(path, overrides=["optim.name=muon"])
    assert check.checked_steps == 3 and not check.counts


@pytest.fixture(scope="module")
def finetune_files(tmp_path_factory):
    from pretrain.datamodules.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("finetune_sync")
    rng, words = random.Random(0), ["the", "film", "plot", "was", "good", "bad", "quite", "really"]
    rows = "".join(f"{' '.join(rng.sample(words, 4))}\t{rng.randint(0, 1)}\n" for _ in range(64))
    (root / "train.tsv").write_text("sentence\tlabel\n" + rows)
    (root / "corpus.txt").write_text(" ".join(words) * 30)
    train_bpe(root / "corpus.txt", 400, root / "tokenizer.json", show_progress=False)
    return root


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_finetuning_steps_read_nothing_from_the_device(tmp_path, finetune_files, kind):
    """A head on BERT (with the guards' device-side skip: finetuning's AdamW is fused now) and T5 text-to-text;
    before: the backbone's input check and the training predictions' boolean mask read the device each step."""
    from pretrain.finetuning.config import validate
    from pretrain.finetuning.run import build_parts

    model = {"vocab_size": 448, "d_model": 32, "n_head": 2, "d_ff": 64, "max_seq_len": 32, **TINY_MODEL[kind]}
    cfg = validate(
        {
            "run_dir": str(tmp_path / "run"),
            "init": {"model": model | {"n_layer": 2}, "tokenizer": str(finetune_files / "tokenizer.json")},
            "head": {"kind": "text2text" if kind == "t5" else "sequence"},
            "data": {
                "task": "sst2",
                "train_file": str(finetune_files / "train.tsv"),
                "micro_batch_size": 8,
                "max_length": 16,
            },
            "trainer": {**TRAINER, "accelerator": "cpu", "sync_check": "error", "progress_bar": False},
            "checkpoint": {"every_n_steps": 2},
        }
    )
    parts = build_parts(cfg)
    trainer = build_trainer(cfg, {})
    trainer.fit(parts.module, datamodule=parts.datamodule)
    check = next(cb for cb in trainer.callbacks if isinstance(cb, SyncCheck))
    assert check.checked_steps == 3 and not check.counts


class ReadsTheLoss(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = outputs["loss"].item()


def test_an_item_in_a_user_callback_stops_the_run_naming_its_line(tmp_path, tiny_world):
    line = inspect.getsourcelines(ReadsTheLoss.on_train_batch_end)[1] + 1
    with pytest.raises(HostSyncError, match=rf"Tensor\.item\(\) at .*test_sync_check\.py:{line} .* step 0"):
        fit(recipe(tmp_path, tiny_world, "clm"), callbacks=[ReadsTheLoss()])


@pytest.mark.parametrize(("strategy", "objective"), [("ddp", "clm"), ("fsdp", "span_corruption")])
def test_two_ranks_read_nothing_from_the_device(tmp_path, tiny_world, strategy, objective):
    path = recipe(tmp_path, tiny_world, objective, devices=2, progress_bar=False)
    backend = ["strategy.ddp.process_group_backend=gloo"] if strategy == "ddp" else []
    proc = subprocess.run(
        cli_command("fit", str(path), f"strategy.name={strategy}", *backend),
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = "sync_check=error: 3 steps that do not log checked (rank 0); host reads: none"
    assert summary in proc.stdout + proc.stderr
