"""What one training step of the fast recipe costs on the CPU, by part: forward + backward and the optimizer
step, CPU milliseconds per step (process time, so a loaded machine skews it less than wall time), for nanoGPT's
CPU model size (4 layers, d=128, context 64, 366-id byte vocabulary):

- ``standard + AdamW``: the AdamW baseline's model (GELU, tied head) and fused AdamW; ``+ QK-norm``: with
  ``qk_norm`` alone (the option that costs time here, dropped from the fast recipe);
- ``fast + AdamW``: the fast recipe's model (``recipes/gpt-tiny-fast.yaml``: muP, ReLU^2, untied head, zero-init
  projections);
- ``fast + Muon``: and ``torch.optim.Muon`` (Newton-Schulz, ``ns_steps``) on its hidden matrices.

    python benchmarks/bench_fast_step.py [--batches 12,48] [--steps 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from bench_time_to_loss import FAST_MODEL

from pretrain.config.run import MuonConfig, OptimConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.optim import build_optimizer

STANDARD = {
    "arch": "decoder",
    "vocab_size": 366,
    "d_model": 128,
    "n_layer": 4,
    "n_head": 4,
    "d_ff": 512,
    "max_seq_len": 64,
    "attn_bias": False,
    "mlp_bias": False,
    "norm_bias": False,
    "dropout": 0.0,
}
FAST = {**STANDARD, **FAST_MODEL}  # the fast recipe of the time-to-loss benchmark


def step_ms(model_cfg: dict, optim: str, ns_steps: int, batch: int, steps: int) -> tuple[float, float]:
    """(forward + backward, optimizer step) CPU ms, mean of ``steps`` after 2 warm-up steps."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_cfg))
    opt = build_optimizer(model, OptimConfig(name=optim, muon=MuonConfig(ns_steps=ns_steps)))
    x = torch.randint(0, model_cfg["vocab_size"], (batch, 65))
    fwd = upd = 0.0
    for i in range(steps + 2):
        t0 = time.process_time()
        F.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        t1 = time.process_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            fwd, upd = fwd + t1 - t0, upd + time.process_time() - t1
    return 1000 * fwd / steps, 1000 * upd / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="12,48")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cases = [
        ("standard + AdamW", STANDARD, "adamw", 5),
        ("standard + QK-norm + AdamW", {**STANDARD, "qk_norm": True}, "adamw", 5),
        ("fast + AdamW", FAST, "adamw", 5),
        ("fast + Muon (5 NS steps)", FAST, "muon", 5),
        ("fast + Muon (3 NS steps)", FAST, "muon", 3),
    ]
    for batch in map(int, args.batches.split(",")):
        for name, cfg, optim, ns in cases:
            fwd, upd = step_ms(cfg, optim, ns, batch, args.steps)
            print(f"batch {batch:>3}  {name:<27} forward+backward {fwd:7.1f} ms  optimizer {upd:6.1f} ms")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
