"""A mixture schedule under Lightning and DDP (2 ranks, gloo): SIGKILL right after the phase boundary and
`resume=auto` ends bitwise equal to an uninterrupted run; tokens per source are logged as scheduled."""

from __future__ import annotations

import pytest
import torch
from training_utils import (
    Background,
    fit_and_kill,
    metric_by_step,
    model_weights,
    read_metrics,
    run_cli,
    tiny_recipe,
)

from pretrain.datamodules.prepare import prepare

STEPS = 8


@pytest.fixture(scope="module")
def two_sources(tiny_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    text = tiny_world["corpus"].read_text()
    dirs = {}
    for name, part in (("web", text[: len(text) // 2]), ("books", text[len(text) // 2 :])):
        (root / f"{name}.txt").write_text(part)
        dirs[name] = root / name
        prepare([root / f"{name}.txt"], tiny_world["tokenizer"], dirs[name], val_fraction=0.1, progress=False)
    return dirs


def schedule_recipe(directory, world, dirs):
    directory.mkdir()
    return tiny_recipe(
        directory,
        world,
        "gpt",
        model={"dropout": 0.1},
        data={
            "sources": [{"name": n, "prepared": str(d)} for n, d in dirs.items()],
            "schedule": {
                "interpolation": "linear",
                "phases": [
                    {"start": 0, "weights": {"web": 0.8, "books": 0.2}},
                    {"start": 3, "weights": {"web": 0.5, "books": 0.5}},
                    {"start": 6, "weights": {"books": 1.0}},
                ],
            },
        },
        strategy={"name": "ddp", "ddp": {"process_group_backend": "gloo"}},
        optim={"decay_steps": STEPS},
        trainer={"devices": 2, "max_steps": STEPS, "val_check_interval": STEPS, "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 1, "save_top_k": 0},
    )


@pytest.mark.slow
def test_two_ranks_killed_after_a_phase_boundary_resume_bitwise(tmp_path, tiny_world, two_sources):
    full = schedule_recipe(tmp_path / "full", tiny_world, two_sources)
    reference = Background("fit", str(full), log=tmp_path / "full.log")
    killed = schedule_recipe(tmp_path / "killed", tiny_world, two_sources)
    step = fit_and_kill(killed, tmp_path / "killed" / "run", kill_at_step=3)
    assert 3 <= step < STEPS
    assert f"steps: {STEPS}" in run_cli("fit", str(killed)).stdout
    reference.wait()
    a = model_weights(tmp_path / "full/run/checkpoints/last.ckpt")
    b = model_weights(tmp_path / "killed/run/checkpoints/last.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(tmp_path / "full" / "run")
    web, books = (metric_by_step(rows, f"train/corpus_tokens/{n}") for n in ("web", "books"))
    per_step = 8 * 33  # 2 ranks x 4 samples of 33 corpus tokens (seq_len 32 + 1)
    assert sorted(web) == list(range(1, STEPS + 1)) and all(web[s] + books[s] == s * per_step for s in web)
    assert web[1] == 6 * 33  # step 1 weighs web 0.8: 6.4 -> 6 of 8 samples
    assert web[STEPS] == web[6]  # steps 7 and 8 read books only
