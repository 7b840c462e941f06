"""The strategy matrix: DDP, FSDP (FSDP2 per block) and DeepSpeed ZeRO-1/2/3 on 2 gloo ranks train tiny GPT / BERT /
T5 to the same losses (relative 1e-5 over 10 steps), with the same weight-decayed parameters and the same FLOPs on
every rank -- with gradient accumulation, activation checkpointing and bf16-mixed (whose gradients must be reduced
in float32 under FSDP as under DDP, or the losses part).

All cells run in one launch of 2 ranks (``strategy_worker.py``); the reference of each cell is the DDP cell of the
same model, accumulation and precision. Gradients are clipped at a norm below the tiny models' gradient norms, so
clipping (which Lightning's FSDP1 strategy refused) is part of what must agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from training_utils import REPO_ROOT, metric_by_step, read_metrics, run_ranks, tiny_recipe

from pretrain import config
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.compat.lightning import PerModuleSharding
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Block, Transformer
from pretrain.parallel.mesh import ParallelDims
from pretrain.training.strategies import build_strategy, deepspeed_config, parallelize, shard_units

GPT = REPO_ROOT / "recipes" / "gpt-tiny.yaml"


def load(*overrides: str, recipe: Path = GPT):
    return config.load(recipe, list(overrides))


def test_ddp_strategy():
    run, _ = load("strategy.name=ddp", "strategy.ddp.process_group_backend=gloo")
    strategy = build_strategy(run)
    assert isinstance(strategy, DDPStrategy) and isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    assert strategy._ddp_kwargs["find_unused_parameters"] is False
    assert strategy._process_group_backend == "gloo"


@pytest.mark.parametrize(
    ("sharding", "dims", "state_dict_type"),
    [
        ("FULL_SHARD", ParallelDims(1, 4, 1), "sharded"),
        ("SHARD_GRAD_OP", ParallelDims(1, 4, 1), "full"),
        ("HYBRID_SHARD", ParallelDims(2, 2, 1), "sharded"),
    ],
)
def test_fsdp_strategy(sharding, dims, state_dict_type):
    run, _ = load(
        "strategy.name=fsdp",
        f"strategy.fsdp.sharding_strategy={sharding}",
        f"strategy.fsdp.state_dict_type={state_dict_type}",
        "trainer.devices=2",
        "trainer.num_nodes=2",
    )
    strategy = build_strategy(run)
    assert isinstance(strategy, PerModuleSharding) and strategy.dims == dims
    assert strategy.parallelize.func is parallelize
    assert strategy.parallelize.keywords["reshard_after_forward"] is (sharding != "SHARD_GRAD_OP")
    assert strategy._save_distributed_checkpoint is (state_dict_type == "sharded")
    assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)


def test_fsdp_shards_the_blocks_the_model_declares():
    """The model names its FSDP units (every block of encoder and decoder), found inside any wrapper module."""
    cfg = ModelConfig(
        arch="encoder-decoder", vocab_size=64, d_model=16, n_layer=2, n_decoder_layer=3, n_head=2
    )
    wrapper = nn.ModuleDict({"model": Transformer(cfg)})
    blocks = [m for m in wrapper.modules() if isinstance(m, Block)]
    assert len(blocks) == 5 and list(map(id, shard_units(wrapper))) == list(map(id, blocks))


def test_fsdp_no_shard_points_to_ddp():
    run, _ = load("strategy.name=fsdp", "strategy.fsdp.sharding_strategy=NO_SHARD")
    with pytest.raises(ValueError, match="use strategy.name=ddp"):
        build_strategy(run)


def test_fsdp_recipe_piece():
    run, _ = config.load(REPO_ROOT / "recipes" / "gpt2-350m.yaml")
    assert run.strategy.name == "fsdp" and run.strategy.fsdp.sharding_strategy == "FULL_SHARD"


@pytest.mark.parametrize(
    ("piece", "stage", "optimizer", "params"),
    [
        ("deepspeed_zero1", 1, False, False),
        ("deepspeed_zero2", 2, False, False),
        ("deepspeed_zero2_offload", 2, True, False),
        ("deepspeed_zero3", 3, False, False),
        ("deepspeed_zero3_offload", 3, True, True),
    ],
)
def test_deepspeed_configs(tmp_path, piece, stage, optimizer, params):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [model/gpt-tiny, strategy/{piece}]\n")
    run, _ = config.load(recipe)
    ds = deepspeed_config(run)
    assert ds["train_micro_batch_size_per_gpu"] == run.data.micro_batch_size  # not Lightning's guess of 1
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) is optimizer and ("offload_param" in zero) is params
    if optimizer:
        assert zero["offload_optimizer"]["device"] == "cpu"


def test_bad_deepspeed_settings():
    run, _ = load(
        "strategy.name=deepspeed", "strategy.deepspeed.stage=1", "strategy.deepspeed.offload_optimizer=true"
    )
    with pytest.raises(ValueError, match="needs ZeRO stage 2 or 3"):
        deepspeed_config(run)
    run, _ = load(
        "strategy.name=deepspeed", "strategy.deepspeed.stage=2", "strategy.deepspeed.offload_parameters=true"
    )
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        deepspeed_config(run)
    run, _ = load(
        "strategy.name=deepspeed",
        "strategy.deepspeed.stage=3",
        "strategy.deepspeed.param_persistence_threshold=-1",
    )
    with pytest.raises(ValueError, match="param_persistence_threshold must be >= 0"):
        deepspeed_config(run)
    run, _ = load("strategy.name=deepspeed", "strategy.deepspeed.stage=3")
    assert deepspeed_config(run)["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000


def test_deepspeed_without_the_package_is_a_clear_error(monkeypatch):
    # a None entry in sys.modules makes `import deepspeed` raise ImportError, installed or not
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    run, _ = load("strategy.name=deepspeed")
    with pytest.raises(ValueError, match="pip install"):
        build_strategy(run)


WORKER = Path(__file__).parents[1] / "strategy_worker.py"
CLIP = 0.5  # below the tiny models' gradient norms: every cell clips
STRATEGY = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    **{f"zero{k}": ["strategy.name=deepspeed", f"strategy.deepspeed.stage={k}"] for k in (1, 2, 3)},
    "fsdp-compiled": ["strategy.name=fsdp", "trainer.compile=true"],  # gpt2-350m on trainer/gpu8
}
# (model, accumulation, extra overrides, strategies besides the DDP reference)
GROUPS = [
    ("gpt", 1, [], ["fsdp", "zero1", "zero2", "zero3", "fsdp-compiled"]),
    ("gpt", 2, [], ["fsdp", "zero2", "zero3"]),
    ("gpt", 2, ["trainer.activation_checkpointing=true"], ["fsdp", "zero3"]),
    ("gpt", 1, ["trainer.precision=bf16-mixed"], ["fsdp"]),
    ("bert", 2, [], ["fsdp", "zero3"]),
    ("t5", 1, [], ["fsdp", "zero2"]),
]


def group_name(kind: str, k: int, extra: list[str]) -> str:
    return "-".join([kind, f"acc{k}", *(e.split(".")[-1].replace("=", "_") for e in extra)])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny_world):
    """Trains every cell once; ``{group: {strategy: cell directory}}``."""
    root = tmp_path_factory.mktemp("matrix")
    cells, layout = [], {}
    for kind, k, extra, strategies in GROUPS:
        group = group_name(kind, k, extra)
        for strategy in ["ddp", *strategies]:
            directory = root / group / strategy
            directory.mkdir(parents=True)
            recipe = tiny_recipe(
                directory,
                tiny_world,
                kind,
                trainer={
                    "devices": 2,
                    "max_steps": 10,
                    "val_check_interval": 100,
                    "accumulate_grad_batches": k,
                    "gradient_clip_val": CLIP,
                },
                checkpoint={"every_n_steps": 100, "save_top_k": 0},
            )
            name = f"{group}.{strategy}"
            cells.append({"name": name, "recipe": str(recipe), "overrides": [*STRATEGY[strategy], *extra]})
            layout.setdefault(group, {})[strategy] = directory
    (root / "cells.json").write_text(json.dumps(cells))
    (root / "out").mkdir()
    run_ranks(WORKER, str(root / "cells.json"), str(root / "out"), log_dir=root)
    return root, layout


CELLS = [(group_name(kind, k, extra), s) for kind, k, extra, strategies in GROUPS for s in strategies]


@pytest.mark.slow
@pytest.mark.parametrize(("group", "strategy"), CELLS, ids=[f"{g}-{s}" for g, s in CELLS])
def test_strategy_matches_ddp(matrix, group, strategy):
    root, layout = matrix
    losses = {
        name: metric_by_step(read_metrics(layout[group][name] / "run"), "train/loss")
        for name in ("ddp", strategy)
    }
    assert sorted(losses["ddp"]) == list(range(1, 11)) and len(set(losses["ddp"].values())) > 1
    norms = {
        name: metric_by_step(read_metrics(layout[group][name] / "run"), "train/grad_norm")
        for name in ("ddp", strategy)
    }
    assert max(norms["ddp"].values()) > CLIP  # clipping is part of what the strategies must agree on
    # the reduced gradient of the same initial weights (DeepSpeed keeps it inside its engine): a bf16 reduction
    # is off by ~1e-4 there; later steps in bf16 part at that level from rounding alone
    if norms[strategy]:
        assert norms[strategy][1] == pytest.approx(norms["ddp"][1], rel=1e-5), norms
    assert sorted(losses[strategy]) == list(range(1, 11))
    worst = max(abs(losses[strategy][s] - v) / abs(v) for s, v in losses["ddp"].items())
    print(f"{group} {strategy}: max relative loss difference to DDP {worst:.2e}")
    assert worst <= 1e-5, (losses["ddp"], losses[strategy])

    def result(name: str, rank: int) -> dict:
        return json.loads((root / "out" / f"{group}.{name}.rank{rank}.json").read_text())

    for rank in (0, 1):  # each rank's FLOPs (MLM's head runs on that rank's targets only) as under DDP
        reference = result("ddp", rank)
        assert reference["decayed"] > 0 and len(reference["flops"]) == 10 * int(group.split("acc")[1][0])
        assert result(strategy, rank)["decayed"] == reference["decayed"]
        assert result(strategy, rank)["flops"] == reference["flops"]
