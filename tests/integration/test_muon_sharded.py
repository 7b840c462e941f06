"""Muon under data parallelism and FSDP2: two gloo ranks, each on half the batch, step exactly as one process on
the whole batch (same weights within 1e-5 after a few steps; the sharded run orthogonalises whole matrices)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from training_utils import free_port

from pretrain.config import OptimConfig
from pretrain.config.run import MuonConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.optim import build_optimizer

CONFIG = ModelConfig(
    vocab_size=64, d_model=32, n_layer=2, n_head=2, d_ff=48, max_seq_len=16, tie_embeddings=False
)
OPTIM = {  # optim.muon.ns_dtype: torch's bfloat16 Newton-Schulz, or ours in float32
    ns: OptimConfig(
        name="muon", lr=1e-2, weight_decay=0.1, muon=MuonConfig(lr=0.02, weight_decay=0.1, ns_dtype=ns)
    )
    for ns in ("bfloat16", "float32")
}
STEPS = 3


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(step))


def train(model: Transformer, halves: tuple[int, ...], ns: str, net: nn.Module | None = None) -> None:
    """STEPS optimizer steps of next-token loss on ``halves`` of each batch, through ``net`` (default ``model``;
    a DDP wrapper). One process backpropagates both halves at weight 1/2, so its gradient is bitwise the
    two ranks' average: Newton-Schulz runs in bfloat16, where a 1-ulp difference in the input would move the
    update by ~1e-2 relative and hide what the test checks."""
    optimizer = build_optimizer(model, OPTIM[ns])
    for step in range(STEPS):
        for half in halves:
            ids = batch(step).chunk(2)[half]
            logits = (net or model)(ids[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            (loss / len(halves)).backward()
        optimizer.step()
        optimizer.zero_grad()


def reference_state(ns: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    train(model, (0, 1), ns)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, port: int, out: dict) -> None:
    """Trains DDP, then FSDP2, for each Newton-Schulz dtype, in one process group; rank 0 stores the full state
    dicts in ``out[(ns, kind)]``."""
    from torch.distributed.device_mesh import init_device_mesh

    from pretrain.training.strategies import shard_model

    torch.set_num_threads(1)  # as the test process computing the reference (tests/conftest.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for ns, kind in itertools.product(sorted(OPTIM), ("ddp", "fsdp")):
            torch.manual_seed(0)
            model = Transformer(CONFIG)
            net = None
            if kind == "ddp":
                net = nn.parallel.DistributedDataParallel(model)
            else:  # FSDP2 as the fsdp strategy applies it: every block, then the backbone
                shard_model(nn.ModuleList([model]), init_device_mesh("cpu", (2,)))
                assert hasattr(model.decoder.blocks[0].attn.q.weight, "full_tensor")  # sharded
            train(model, (rank,), ns, net)
            state = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model.state_dict().items()}
            if rank == 0:
                out[(ns, kind)] = {k: v.detach().clone() for k, v in state.items()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_states() -> dict:
    """Both dtypes' DDP and FSDP2 runs in one launch of 2 ranks (each rank imports torch and Lightning once)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(worker, args=(free_port(), out), nprocs=2, start_method="spawn")
        return dict(out)


@pytest.mark.parametrize("ns", sorted(OPTIM))
def test_muon_two_ranks_ddp_and_fsdp_equal_one_process(sharded_states, ns):
    expected = reference_state(ns)
    for kind in ("ddp", "fsdp"):
        got = sharded_states[(ns, kind)]
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=f"{kind}: {key}")
