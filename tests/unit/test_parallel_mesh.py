"""The run's mesh (``pretrain.parallel.mesh``): its dims from the config, and every setting it cannot have refused
by config validation in one line naming the fix, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from training_utils import one_error_line

from pretrain import config
from pretrain.parallel.mesh import ParallelDims

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt-tiny.yaml"
FSDP_TP2 = ["strategy.name=fsdp", "strategy.tensor_parallel=2", "trainer.devices=4"]
FSDP_CP2 = ["strategy.name=fsdp", "strategy.context_parallel=2", "trainer.devices=2"]


def test_dims_from_the_config():
    run, _ = config.load(RECIPE, FSDP_TP2)
    dims = ParallelDims.of(run)
    assert (dims.sizes, dims.world, dims.dp) == ((1, 2, 1, 2), 4, 2)
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a tp group's ranks are consecutive
    run, _ = config.load(
        RECIPE, [*FSDP_TP2, "trainer.num_nodes=2", "strategy.fsdp.sharding_strategy=HYBRID_SHARD"]
    )
    assert ParallelDims.of(run).sizes == (2, 2, 1, 2)
    run, _ = config.load(RECIPE, ["strategy.name=fsdp", "trainer.devices=4"])
    assert ParallelDims.of(run).sizes == (1, 4, 1, 1)
    run, _ = config.load(RECIPE, [*FSDP_TP2, "trainer.devices=8", "strategy.context_parallel=2"])
    dims = ParallelDims.of(run)
    assert (dims.sizes, dims.dp) == ((1, 2, 2, 2), 2)  # dp_replicate, dp_shard, cp, tp
    assert [(dims.dp_rank(r), dims.cp_rank(r)) for r in range(8)] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)
    ]  # fmt: skip


BAD = [
    (["strategy.name=ddp", "strategy.tensor_parallel=2"], r"strategy.tensor_parallel=2 needs strategy.name=fsdp"),
    (["strategy.name=deepspeed", "strategy.tensor_parallel=2"], r"needs strategy.name=fsdp .*deepspeed"),
    (["strategy.name=fsdp", "strategy.tensor_parallel=2", "trainer.devices=3"], r"trainer.devices=3 is not a multiple"),
    ([*FSDP_TP2, "model.n_head=1"], r"^model.n_head=1 is not divisible by strategy.tensor_parallel=2"),
    ([*FSDP_TP2, "model.n_head=2", "model.n_kv_head=1"], r"^model.n_kv_head=1 is not divisible"),
    ([*FSDP_TP2, "model.d_ff=511"], r"^model.d_ff=511 is not divisible"),
    ([*FSDP_TP2, "model.vocab_size=1023"], r"^model.vocab_size=1023 is not divisible"),
    (["strategy.name=fsdp", "strategy.sequence_parallel=true"], r"sequence_parallel=true .* strategy.tensor_parallel >= 2"),
    ([*FSDP_TP2, "strategy.fsdp.cpu_offload=true"], r"cpu_offload=true with strategy.tensor_parallel"),
    ([*FSDP_TP2, "eval_during_fit.tasks=[arc_easy]"], r"eval_during_fit with strategy.tensor_parallel"),
    (["strategy.name=ddp", "strategy.context_parallel=2"], r"strategy.context_parallel=2 needs strategy.name=fsdp"),
    ([*FSDP_CP2, "strategy.tensor_parallel=2"], r"trainer.devices=2 is not a multiple of .* x strategy.context_parallel=2"),
    ([*FSDP_CP2, "data.seq_len=126"], r"^data.seq_len=126 is not a multiple of 2 x strategy.context_parallel = 4"),
    ([*FSDP_CP2, "strategy.context_parallel=0"], r"^strategy.context_parallel must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[m.split(" ")[0].strip("^") for _, m in BAD])
def test_bad_parallel_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        config.load(RECIPE, overrides)
    assert "\n" not in str(err.value) and not dist.is_initialized()


def test_the_cli_refuses_before_any_work(capsys):
    line = one_error_line(capsys, "fit", RECIPE, "strategy.name=ddp", "strategy.tensor_parallel=2")
    assert "set strategy.name=fsdp" in line
