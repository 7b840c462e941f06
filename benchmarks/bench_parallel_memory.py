"""Per-rank memory under tensor and context parallelism (issue 28 goal 4), measured on 2 real gloo ranks with torch's
``MemTracker`` as ``pretrain plan`` uses it (``pretrain.compat.memory``):

- TP: parameters + gradients + optimizer state (AdamW, the project's ``build_optimizer``) per rank of a small
  Llama-style decoder split by its tensor-parallel plan over 2 ranks, against the same model in one process: the
  tracker's snapshot after a step whose gradients are kept (``held_state``). Target: TP=2 <= 0.55 x TP=1.
- CP: activations (everything at the peak of two training steps but parameters, gradients and optimizer state,
  ``trace_peak``) per rank of a tiny decoder at T = 4,096 tokens with each rank holding half of every sequence,
  against one process holding all of it. Target: CP=2 <= 0.6 x CP=1. Twice: under a plain causal mask
  (``cp1`` / ``cp2``) and, as the default GPT recipe trains (``data.document_mask``), causal within packed
  documents with positions restarting in each (``cp1d`` / ``cp2d``; document lengths drawn from 64-1,024 tokens).

Every rank also measures the unsplit model itself (the ``tp1`` / ``cp1`` rows), so both sides of a ratio come
from the same launch. Prints one table and the load average.

    python benchmarks/bench_parallel_memory.py [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from pretrain.compat.memory import held_state, trace_peak
from pretrain.config.run import OptimConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.objectives.base import document_positions
from pretrain.objectives.loss import token_cross_entropy
from pretrain.optim import build_optimizer
from pretrain.parallel.context import SequenceShard, apply_context_parallel
from pretrain.parallel.tensor import apply_tensor_parallel, vocabulary_parallel

LLAMA = {"norm": "rmsnorm", "norm_bias": False, "position": "rope", "activation": "swiglu",
         "attn_bias": False, "mlp_bias": False}  # fmt: skip
# TP: the layers' matrices dominate, as in any real model (replicated: norms only)
TP_MODEL = ModelConfig(vocab_size=8192, d_model=256, n_layer=2, n_head=4, d_ff=704, max_seq_len=128,
                       tie_embeddings=False, **LLAMA)  # fmt: skip
# CP: a tiny model at a long context
CP_MODEL = ModelConfig(vocab_size=512, d_model=128, n_layer=2, n_head=2, d_ff=344, max_seq_len=4096, **LLAMA)


def steps(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, parallel: bool
) -> tuple[Any, Any]:
    """(``trace_peak``'s two training steps -- forward, summed cross entropy, backward, AdamW step -- on one batch,
    ``held_state`` after a third whose gradients are kept)."""
    optimizer = build_optimizer(model, OptimConfig())

    def step(keep_grads: bool = False) -> None:
        with vocabulary_parallel(parallel):
            token_cross_entropy(model(**inputs).logits, labels)[0].backward()
        optimizer.step()
        if not keep_grads:
            optimizer.zero_grad(set_to_none=True)

    peak = trace_peak(model, optimizer, step)
    step(keep_grads=True)
    return peak, held_state(model, optimizer)


def document_ids(seq_len: int) -> torch.Tensor:
    """(1, seq_len) ids of packed documents of 64-1,024 tokens (a fixed draw)."""
    lengths = torch.randint(64, 1025, (seq_len // 64,), generator=torch.Generator().manual_seed(2))
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:seq_len][None]


def worker(rank: int, rendezvous: str, seq_len: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2,))
        results = {}
        # tensor parallelism: next-token prediction on (2, 64)
        ids = torch.randint(0, TP_MODEL.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        whole = Transformer(TP_MODEL)
        split = copy.deepcopy(whole)
        results["tp1"] = steps(whole, {"input_ids": ids[:, :-1]}, ids[:, 1:], False)
        apply_tensor_parallel(split, mesh)
        results["tp2"] = steps(split, {"input_ids": ids[:, :-1]}, ids[:, 1:], True)
        # context parallelism: next-token prediction on (1, T), this rank's positions of it under CP=2
        ids = torch.randint(
            0, CP_MODEL.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1)
        )
        documents = document_ids(seq_len)
        for suffix, extra in (
            ("", {}),
            ("d", {"document_ids": documents, "position_ids": document_positions(documents)}),
        ):
            batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], **extra}
            torch.manual_seed(0)
            whole = Transformer(CP_MODEL)
            split = copy.deepcopy(whole)
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            results[f"cp1{suffix}"] = steps(whole, inputs, batch["labels"], False)
            apply_context_parallel(split, mesh.get_group())
            local = SequenceShard(rank, 2)(batch)
            inputs = {k: v for k, v in local.items() if k != "labels"}
            results[f"cp2{suffix}"] = steps(split, inputs, local["labels"], False)
        out[rank] = results
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    args = p.parse_args()
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.start_processes(worker, args=(rendezvous, args.seq_len, out), nprocs=2, start_method="spawn")
        results = dict(out)
    mib = 2**20
    print(
        f"{'rank':>4} {'what':>4} {'params':>9} {'grads':>9} {'optim':>9} {'p+g+o':>9} | {'activ.':>9} {'peak':>9}  MiB"
    )
    for rank, r in sorted(results.items()):
        for what, (peak, held) in r.items():
            cells = [held["params"], held["grads"], held["optimizer"], sum(held.values())]
            cells += [peak["activations"], peak["total"]]
            print(f"{rank:>4} {what:>4} " + " ".join(f"{c / mib:9.2f}" for c in cells[:4]), end=" | ")
            print(" ".join(f"{c / mib:9.2f}" for c in cells[4:]))
    for rank, r in sorted(results.items()):
        state = sum(r["tp2"][1].values()) / sum(r["tp1"][1].values())
        activations = r["cp2"][0]["activations"] / r["cp1"][0]["activations"]
        documents = r["cp2d"][0]["activations"] / r["cp1d"][0]["activations"]
        print(
            f"rank {rank}: TP=2 / TP=1 params+grads+optimizer {state:.3f} (target <= 0.55); "
            f"CP=2 / CP=1 activations at T={args.seq_len} {activations:.3f}, packed documents {documents:.3f} "
            "(target <= 0.6)"
        )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
