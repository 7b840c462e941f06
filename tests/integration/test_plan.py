"""``pretrain plan``: the traced estimate (fake tensors, no memory) of a training step's peak matches the peak of
the same steps on real CPU tensors within 15 %, with and without activation checkpointing; the table lists every
strategy (and with ``--tp`` / ``--cp`` FSDP2 x TP x CP) with the largest micro-batch that fits; bad sizes and
meshes fail in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain import config
from pretrain.cli import main
from pretrain.compat.memory import trace_peak
from pretrain.training import plan

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.micro_batch_size=4", "data.seq_len=32", "model.max_seq_len=64"]


def measured_peak(run, micro_batch: int, checkpointing: bool) -> int:
    """Two real training steps on the CPU (real tensors, real kernels), their peak by the memory tracker."""
    model, optimizer = plan.build(run, checkpointing)
    batch = plan.synthetic_batch(run, micro_batch)
    step = lambda: plan.train_step(model, optimizer, batch, run.trainer.precision)
    return trace_peak(model, optimizer, step)["total"]


CASES = [("gpt-tiny", "32-true", True), ("bert-tiny", "bf16-mixed", False), ("t5-tiny", "32-true", True)]


@pytest.mark.parametrize(("recipe", "precision", "checkpointing"), CASES)
def test_traced_peak_is_within_15_percent_of_the_measured_cpu_peak(recipe, precision, checkpointing):
    run, _ = config.load(REPO / "recipes" / f"{recipe}.yaml", [*SMALL, f"trainer.precision={precision}"])
    estimate = plan.trace(run, 4, checkpointing)
    measured = measured_peak(run, 4, checkpointing)
    assert estimate.peak == pytest.approx(measured, rel=0.15)
    assert estimate.params > 0 and estimate.optimizer >= 2 * estimate.params * 0.9  # AdamW: 2 moments
    assert estimate.activations > 0


@pytest.mark.heavy  # the plan's accuracy against real runs: the traced-peak and gloo-row tests
def test_checkpointing_lowers_activations_and_sharding_lowers_the_per_gpu_total():
    """Every strategy, and (``--tp 2 --cp 2`` on 4 GPUs) FSDP2 x TP x CP: its parameters are the tensor-parallel
    halves, FSDP2-sharded over dp x cp = 2 (between a quarter and a half of the model: what stays whole under TP,
    norms and the position table, is halved once), its activations those of half of every sequence."""
    run, _ = config.load(REPO / "recipes" / "gpt-tiny.yaml", SMALL)
    run = plan.with_layout(run, 4, 2, 2)
    rows = {(r.strategy, r.checkpointing): r for r in plan.plan(run, gpus=4, gpu_memory=2**30)}
    assert {s for s, _ in rows} == {*plan.STRATEGIES, "fsdp+tp2+cp2"}
    for strategy in (*plan.STRATEGIES, "fsdp+tp2+cp2"):
        off, on = rows[strategy, False], rows[strategy, True]
        assert on.parts["activations"] < off.parts["activations"]
        assert on.max_micro_batch > off.max_micro_batch > 4
    ddp, fsdp = rows["ddp", False].parts, rows["fsdp", False].parts
    assert fsdp["params"] == ddp["params"] // 4  # FSDP2 traced on 4 fake ranks: rank 0's shards
    assert fsdp["optimizer"] == pytest.approx(ddp["optimizer"] / 4, rel=0.01)  # AdamW's step counts: whole
    assert rows["zero3-offload", False].parts["optimizer"] == 0
    layout = rows["fsdp+tp2+cp2", False].parts
    assert ddp["params"] / 4 <= layout["params"] < ddp["params"] / 2
    assert layout["optimizer"] == pytest.approx(
        2 * layout["params"], rel=0.01
    )  # AdamW's moments of its shards
    assert (
        layout["activations"] < 0.6 * fsdp["activations"]
    )  # half the positions, a rank's heads and MLP width


def test_cli_prints_the_table_and_refuses_a_bad_size_in_one_line(capsys):
    from training_utils import one_error_line

    recipe = str(REPO / "recipes" / "gpt-tiny.yaml")
    assert main(["plan", recipe, *SMALL, "--gpus", "2", "--gpu-memory", "512MiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "2 GPU(s) of 0 GiB" in out[0] or "2 GPU(s)" in out[0]
    assert len(out) == 2 + 2 * len(plan.STRATEGIES) and out[2].split()[0] == "ddp"
    assert main(["plan", recipe, "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain plan: error: --gpu-memory 'lots' is not a size") and "\n" not in err
    assert plan.parse_bytes("80GiB") == plan.parse_bytes("80G") == 80 * 2**30
    for args, message in (  # a mesh training would refuse, before anything is traced
        (["--gpus", "3", "--tp", "2"], "--gpus 3 is not a multiple of --tp 2 x --cp 1 = 2"),
        (
            ["--gpus", "6", "--cp", "3"],
            "data.seq_len=32 is not a multiple of 2 x strategy.context_parallel = 6",
        ),
        (["--gpus", "8", "--tp", "8"], "model.n_head=4 is not divisible by strategy.tensor_parallel=8"),
    ):
        assert message in one_error_line(capsys, "plan", recipe, *SMALL, *args)


# DeepSpeed's reduction buffers are reduce_bucket_size elements whatever the model's size (2e8 by default: 1.6 GB
# here); at half the tiny model's size the rows test the rest of the plan too
BUCKETS = ["strategy.deepspeed.reduce_bucket_size=500000", "strategy.deepspeed.allgather_bucket_size=500000"]


def test_sharded_rows_against_a_two_rank_gloo_run(tmp_path):
    """DDP, FSDP2 (the project's ``shard_model``), FSDP2 x TP=2, FSDP2 x CP=2 and DeepSpeed ZeRO-1/2/3 on 2 gloo
    ranks, real tensors, in one launch: each row (DDP: the single-device trace + the reducer's copy of the gradients;
    FSDP, with TP or CP: the run's parallelism itself traced on 2 fake ranks; ZeRO: DeepSpeed's allocation rules on
    the traced model) is within 15 % of the
    measured per-rank peak; sharding lowers it as each stage should."""
    import json

    from plan_worker import LAYOUTS, layout_estimate
    from training_utils import run_ranks

    worker = REPO / "tests" / "plan_worker.py"
    run_ranks(
        worker, str(REPO / "recipes" / "gpt-tiny.yaml"), str(tmp_path), *SMALL, *BUCKETS, log_dir=tmp_path
    )
    run, _ = config.load(REPO / "recipes" / "gpt-tiny.yaml", [*SMALL, *BUCKETS])
    layouts = {strategy: layout_estimate(run, strategy, 2) for strategy in LAYOUTS}  # here: no real group
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert LAYOUTS.keys() <= result.keys()
        for strategy, row in result.items():
            estimate = layouts[strategy] if strategy in LAYOUTS else row["estimate"]
            assert estimate == pytest.approx(row["measured"], rel=0.15), strategy
        measured = {strategy: row["measured"] for strategy, row in result.items()}
        assert measured["fsdp"] < measured["ddp"] and measured["zero1"] < measured["ddp"]
