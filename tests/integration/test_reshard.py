"""Reload anywhere (``pretrain.checkpoint.reshard``): a checkpoint written under one strategy and world
size continues under another with the same global batch (8 samples per step) -- the next 20 losses equal an
uninterrupted run's to 1e-6 (relative) and every step reads exactly the samples the uninterrupted run's step read
(none twice, none skipped; recorded by ``training_utils.record_sample_indices``).

Two launches of gloo ranks. On 2 ranks: the reference (DDP, 24 steps, synchronous saves), the checkpoints of step 4
(FSDP2 and DDP written by ``checkpoint.async_save``: their first 4 losses are the reference's too; DeepSpeed
ZeRO-2 and ZeRO-1; FSDP2 x TP=2 and FSDP2 x CP=2, one data-parallel rank of micro-batch 8), and their resumes on
2 ranks: FSDP2 -> DDP, ZeRO-2 -> DDP, DDP -> ZeRO-3, ZeRO-1 -> DDP. On 1 rank: FSDP2 (2 ranks) -> FSDP2 (1 rank,
micro-batch 8), ZeRO-2 (2 ranks) -> one device (micro-batch 4, 2 accumulated), TP=2 and CP=2 (2 ranks) -> DDP
(1 rank, micro-batch 8). A different global batch is refused in one line, or continues with
``resume_allow=[batch]`` where the warning says.
"""

from __future__ import annotations

import pytest
import torch
from training_utils import (
    REPO_ROOT,
    launch_losses,
    metric_by_step,
    one_error_line,
    read_metrics,
    record_sample_indices,
    run_ranks,
    samples_by_step,
    tiny_recipe,
)

from pretrain.checkpoint import kind
from pretrain.checkpoint.resume import checkpoint_step
from pretrain.cli import main

WORKER = REPO_ROOT / "tests" / "reshard_worker.py"
SAVED, STEPS, BATCH = 4, 24, 8  # checkpoints of step 4, resumed for 20 steps; samples per step
SOURCES = {
    "fsdp": ["strategy.name=fsdp", "checkpoint.async_save=true"],
    "zero2": ["strategy.name=deepspeed", "strategy.deepspeed.stage=2"],
    "ddp": ["strategy.name=ddp", "checkpoint.async_save=true"],
    "zero1": ["strategy.name=deepspeed", "strategy.deepspeed.stage=1"],
    # FSDP2 x TP=2 on 2 ranks: one data-parallel rank, reading the 8 samples of a step on both ranks
    "tp2": ["strategy.name=fsdp", "strategy.tensor_parallel=2", "data.micro_batch_size=8"],
    # FSDP2 x CP=2 on 2 ranks: one data-parallel rank, each sequence of the 8 split over both ranks
    "cp2": ["strategy.name=fsdp", "strategy.context_parallel=2", "data.micro_batch_size=8"],
}
TWO_RANKS = {  # resumed run: (source, overrides)
    "fsdp-to-ddp": ("fsdp", ["strategy.name=ddp"]),
    "zero2-to-ddp": ("zero2", ["strategy.name=ddp"]),
    "ddp-to-zero3": ("ddp", ["strategy.name=deepspeed", "strategy.deepspeed.stage=3"]),
    "zero1-to-ddp": ("zero1", ["strategy.name=ddp"]),
}
ONE_RANK = {
    "fsdp-2-to-fsdp-1": ("fsdp", ["strategy.name=fsdp", "data.micro_batch_size=8"]),
    "zero2-2-to-one-device": ("zero2", ["strategy.name=auto", "trainer.accumulate_grad_batches=2"]),
    "tp2-to-ddp-1": ("tp2", ["strategy.name=ddp", "data.micro_batch_size=8"]),
    "cp2-to-ddp-1": ("cp2", ["strategy.name=ddp", "data.micro_batch_size=8"]),
}
DATA_RANKS = {
    "tp2": "samples.rank0.jsonl",
    "cp2": "samples.rank0.jsonl",
}  # whose samples a run read (default: every rank's)


def last(root, name):
    return root / name / "run" / "checkpoints" / "last.ckpt"


def fit(root, world, name, *overrides, devices=2):
    (root / name).mkdir(exist_ok=True)
    recipe = tiny_recipe(
        root / name,
        world,
        "gpt",
        trainer={"devices": devices, "max_steps": STEPS, "val_check_interval": STEPS, "limit_val_batches": 0},
        optim={"warmup_steps": 2, "decay_steps": STEPS},  # one schedule, whatever max_steps a launch has
        checkpoint={"every_n_steps": SAVED, "save_top_k": 0},
    )
    return ["fit", str(recipe), *overrides]


def commands(runs):
    out = []
    for command in runs:
        out += [*(["+"] if out else []), *command]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_world):
    root = tmp_path_factory.mktemp("reshard")
    two = [fit(root, tiny_world, "reference", "strategy.name=ddp")]
    two += [fit(root, tiny_world, name, *o, f"trainer.max_steps={SAVED}") for name, o in SOURCES.items()]
    for name, (source, overrides) in TWO_RANKS.items():
        two.append(fit(root, tiny_world, name, *overrides, f"resume={last(root, source)}"))
    run_ranks(WORKER, *commands(two), world_size=2, log_dir=root, timeout=1800)
    one = [
        fit(
            root, tiny_world, name, "trainer.devices=1", *overrides, f"resume={last(root, source)}", devices=1
        )
        for name, (source, overrides) in ONE_RANK.items()
    ]
    run_ranks(WORKER, *commands(one), world_size=1, log_dir=root, timeout=1800)
    return root


def losses(root, name):
    return metric_by_step(read_metrics(root / name / "run"), "train/loss")


@pytest.mark.slow
def test_sources_are_async_dcp_directories_and_deepspeed(runs):
    for name in SOURCES:
        assert checkpoint_step(last(runs, name)) == SAVED
    assert (
        kind(last(runs, "fsdp"))
        == kind(last(runs, "ddp"))
        == kind(last(runs, "tp2"))
        == kind(last(runs, "cp2"))
        == "dcp"
    )
    assert kind(last(runs, "zero2")) == kind(last(runs, "zero1")) == "deepspeed"
    reference = losses(runs, "reference")
    for name in SOURCES:  # written in the background or not, the same training
        assert losses(runs, name) == pytest.approx({s: reference[s] for s in range(1, SAVED + 1)}, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO_RANKS, *ONE_RANK])
def test_resumed_under_another_layout_continues_the_uninterrupted_run(runs, name):
    reference, resumed = losses(runs, "reference"), losses(runs, name)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))  # 20 steps, after the checkpoint's
    assert resumed == pytest.approx({s: reference[s] for s in resumed}, rel=1e-6)
    source = (TWO_RANKS | ONE_RANK)[name][0]
    expected = samples_by_step(runs / "reference" / "run")
    read = samples_by_step(runs / source / "run", DATA_RANKS.get(source)) | samples_by_step(
        runs / name / "run"
    )
    assert read == expected  # each step reads the uninterrupted run's samples
    stream = [i for step in read.values() for i in step]
    assert sorted(stream) == list(range(STEPS * BATCH))  # none twice, none skipped
    assert not (runs / name / "run" / ".resume").exists()  # DeepSpeed's conversion is removed after the fit


@pytest.mark.slow
def test_another_global_batch_is_refused_or_continues_where_the_warning_says(
    runs, tiny_world, capsys, monkeypatch
):
    source = last(runs, "ddp")
    line = one_error_line(
        capsys, *fit(runs, tiny_world, "refused", "trainer.devices=1", f"resume={source}", devices=1)
    )
    assert "samples per step (data.micro_batch_size x" in line and "checkpoint 8 vs config 4" in line
    assert "resume_allow=[batch]" in line
    for owner, attribute, patched in record_sample_indices():
        monkeypatch.setattr(owner, attribute, patched)
    args = fit(runs, tiny_world, "allowed", "trainer.devices=1", "data.micro_batch_size=12", devices=1)
    with pytest.warns(
        UserWarning, match=r"continues at sample 24 of epoch 0 \(8 samples before it, .* read again\)"
    ):
        assert (
            main([*args, f"resume={source}", "resume_allow=[batch]", f"trainer.max_steps={SAVED + 2}"]) == 0
        )
    read = samples_by_step(runs / "allowed" / "run")
    assert read == {SAVED: list(range(24, 36)), SAVED + 1: list(range(36, 48))}
    assert len(launch_losses(runs / "allowed" / "run")) == 1


@pytest.mark.slow
def test_convert_streams_the_bytes_of_todays_consolidation_and_merge_reads_every_layout(runs, tmp_path):
    """``consolidate`` (``pretrain convert --to single``) of DCP directories written by 2 ranks (FSDP2's dim-0 shards,
    read straight into place; DDP's by async save) is byte-identical to today's: every tensor read by DCP into
    memory, then ``torch.save`` through ``AtomicCheckpointIO``. A merge over a file, a DCP and a DeepSpeed
    directory is the float32 weighted average of their weights, bitwise."""
    from pretrain.checkpoint.convert import consolidate, full_checkpoint, load_model
    from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
    from pretrain.checkpoint.merge import merge

    for name in ("fsdp", "ddp"):
        streamed = consolidate(last(runs, name), tmp_path / f"{name}.ckpt")
        AtomicCheckpointIO().save_checkpoint(
            full_checkpoint(last(runs, name)), tmp_path / f"{name}-whole.ckpt"
        )
        assert streamed.read_bytes() == (tmp_path / f"{name}-whole.ckpt").read_bytes(), name
    inputs = [last(runs, "reference"), last(runs, "fsdp"), last(runs, "zero2")]
    weights = [0.5, 0.25, 0.25]
    merged, _, _ = load_model(merge(inputs, tmp_path / "merged.ckpt", weights))
    states = [load_model(path)[0].state_dict() for path in inputs]
    for key, value in merged.state_dict().items():
        total = torch.zeros(value.shape)
        for state, weight in zip(states, weights, strict=True):
            total = total + weight * state[key].float()
        assert torch.equal(value, total), key
