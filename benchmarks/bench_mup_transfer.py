"""muP learning-rate transfer: sweep the learning rate (x2 grid) at several widths, under standard
parametrization and under muP (``model.parametrization: mup``, base width = the smallest width), and report
where the best learning rate lands per width.

Under muP the best learning rate should stay within one grid step across widths (Yang et al. 2022, "Tensor
Programs V", fig. 1); under standard parametrization it drifts (down, with width). Corpus: WikiText-2 (the
shared data's ``lm/wikitext-2/valid.txt``; first 90 % trains, last 10 % scores) as bytes (vocabulary 256), or
the shipped Tiny Shakespeare without ``--data``. Each run: the backbone (``pretrain.models.transformer``) and the
run's optimizer (``pretrain.training.optim.build_optimizer``, AdamW or Muon), ``--steps`` steps of random
64-byte windows, batch 16, linear warmup 10 % then constant; the score is the mean held-out loss (nats/byte)
over 64 fixed windows.

    python benchmarks/bench_mup_transfer.py [--data ../shared/data] [--widths 64,128,256,512]
        [--lrs 3.9e-4,...] [--steps 300] [--optim adamw|muon] [--plot docs/mup_transfer.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.config import OptimConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.training.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]


def corpus(data: Path | None) -> tuple[np.ndarray, np.ndarray]:
    path = (
        data / "lm" / "wikitext-2" / "valid.txt"
        if data
        else REPO / "recipes" / "data" / "tinyshakespeare.txt"
    )
    ids = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def windows(ids: np.ndarray, n: int, rng: np.random.Generator) -> torch.Tensor:
    start = rng.integers(0, len(ids) - 65, n)
    return torch.from_numpy(np.stack([ids[s : s + 65] for s in start]))


def train_one(parametrization: str, width: int, base: int, lr: float, args, train, val) -> float:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256,
        d_model=width,
        n_layer=2,
        n_head=max(1, width // 32),
        max_seq_len=64,
        parametrization=parametrization,
        mup_base_width=base,
        tie_embeddings=False,
    )
    model = Transformer(cfg)
    optim = OptimConfig(name=args.optim, lr=lr, weight_decay=0.0)
    optim.muon.lr = lr * args.muon_ratio
    optimizer = build_optimizer(model, optim, width_mult=cfg.width_mult)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        batch = windows(train, 16, rng)
        loss = F.cross_entropy(model(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
        if not torch.isfinite(loss):
            return float("inf")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    model.eval()
    batch = windows(val, 64, np.random.default_rng(1))
    with torch.no_grad():
        loss = F.cross_entropy(model(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
    return float(loss) if torch.isfinite(loss) else float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data", type=Path, default=None, help="shared data directory (default: the shipped corpus)"
    )
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--lrs", default=",".join(f"{1e-3 * 2.0**k:.3g}" for k in range(-3, 5)))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--optim", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--muon-ratio", type=float, default=10.0, help="Muon lr = ratio x the swept (AdamW) lr")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "mup_transfer.png")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    train, val = corpus(args.data)
    results: dict[str, dict[int, list[float]]] = {}
    start = time.monotonic()
    for parametrization in ("standard", "mup"):
        results[parametrization] = {}
        for width in widths:
            losses = [train_one(parametrization, width, widths[0], lr, args, train, val) for lr in lrs]
            results[parametrization][width] = losses
            best = lrs[int(np.argmin(losses))]
            print(
                f"{parametrization:<8} width {width:>4}: best lr {best:.3g}  "
                + " ".join(f"{x:.3f}" for x in losses),
                flush=True,
            )
    for parametrization, per_width in results.items():
        best = [int(np.argmin(v)) for v in per_width.values()]
        spread = max(best) - min(best)
        print(
            f"{parametrization}: best-lr grid index per width {best}; spread {spread} grid step(s) "
            f"({'within one step' if spread <= 1 else 'drifts'})"
        )
    print(f"{time.monotonic() - start:.0f} s; load average {os.getloadavg()[0]:.1f}")
    plot(results, lrs, args.plot)
    if args.json:
        args.json.write_text(json.dumps({"lrs": lrs, "results": results}, indent=1))


def plot(results: dict, lrs: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, (parametrization, per_width) in zip(axes, results.items(), strict=True):
        for width, losses in per_width.items():
            shown = [x if math.isfinite(x) else np.nan for x in losses]
            ax.plot(lrs, shown, marker="o", label=f"d_model {width}")
        ax.set(xscale="log", xlabel="learning rate", title=parametrization)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out loss (nats/byte)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
