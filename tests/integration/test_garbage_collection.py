"""trainer.gc_every_n_steps: no automatic collection while the steps run, one young-generation collection every N
optimizer steps (seen by ``gc.callbacks``), Python's GC state back after fit."""

from __future__ import annotations

import gc

import pytest
from lightning.pytorch.callbacks import Callback
from training_utils import tiny_recipe

from pretrain import config
from pretrain.training.setup import prepare_run
from pretrain.training.trainer import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class CyclesAndCollections(Callback):
    """Makes cyclic garbage every micro-batch (more than enough for Python's automatic generation-0 threshold) and
    records (optimizer step, generation) of every collection that starts while training runs."""

    def __init__(self) -> None:
        self.collections: list[tuple[int, int]] = []
        self._trainer = None

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start" and self._trainer is not None and self._trainer.training:
            self.collections.append((self._trainer.global_step, info["generation"]))

    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer = trainer
        gc.callbacks.append(self._record)

    def on_train_batch_start(self, trainer, pl_module, batch, idx) -> None:
        for _ in range(2000):
            cycle: list = []
            cycle.append(cycle)

    def on_train_end(self, trainer, pl_module) -> None:
        gc.callbacks.remove(self._record)


def collections_during_fit(tmp_path, world, every: int, k: int) -> list[tuple[int, int]]:
    steps = 6
    tmp_path.mkdir()
    recipe = tiny_recipe(
        tmp_path,
        world,
        trainer={
            "max_steps": steps,
            "accumulate_grad_batches": k,
            "val_check_interval": steps,
            "gc_every_n_steps": every,
        },
    )
    run, resolved = config.load(recipe)
    parts = prepare_run(run, resolved)
    recorder = CyclesAndCollections()
    trainer = build_trainer(run, resolved, callbacks=[recorder], loggers=[])
    trainer.fit(parts.module, datamodule=parts.datamodule)
    assert gc.isenabled()  # Python's automatic GC is back after fit
    return recorder.collections


def test_collections_follow_the_step_schedule(tmp_path, tiny_world):
    automatic = collections_during_fit(tmp_path / "auto", tiny_world, every=0, k=1)
    assert len(automatic) >= 6 and {g for _, g in automatic} >= {0}  # the garbage does trigger Python's GC
    scheduled = collections_during_fit(tmp_path / "scheduled", tiny_world, every=2, k=2)
    # after the 2nd micro-batch of steps 2, 4, 6: generation 1 only (young objects; never a scan of everything)
    assert [c for c in scheduled if c != (0, 1)] == [(2, 1), (4, 1), (6, 1)]


def collections_before_training(monkeypatch, recipe, *overrides: str) -> int:
    """Automatic collections while ``pretrain fit`` (in-process) builds the run, until training starts."""
    from pretrain.cli import main
    from pretrain.training import setup

    counts = {"collections": 0, "setting_up": False}

    def record(phase: str, info: dict) -> None:
        counts["collections"] += phase == "start" and counts["setting_up"]

    built = setup.prepare_run

    def prepare_with_cycles(*args, **kwargs):
        counts["setting_up"] = True
        for _ in range(5000):  # set-up garbage, beyond Python's generation-0 threshold
            cycle: list = []
            cycle.append(cycle)
        return built(*args, **kwargs)

    monkeypatch.setattr(setup, "prepare_run", prepare_with_cycles)
    monkeypatch.setattr(
        Callback, "on_train_start", lambda self, *a: counts.__setitem__("setting_up", False), raising=True
    )
    gc.callbacks.append(record)
    try:
        assert main(["fit", str(recipe), *overrides]) == 0
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()
    return counts["collections"]


def test_no_collection_while_fit_sets_up(monkeypatch, tmp_path, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, trainer={"max_steps": 1, "val_check_interval": 1})
    assert (
        collections_before_training(
            monkeypatch, recipe, "trainer.gc_every_n_steps=0", "run_dir=" + str(tmp_path / "a")
        )
        > 0
    )
    assert collections_before_training(monkeypatch, recipe, "run_dir=" + str(tmp_path / "b")) == 0
