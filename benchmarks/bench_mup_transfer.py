"""muP learning-rate transfer: sweep the AdamW learning rate (x2 grid) at several widths under standard
parametrization and under muP (``model.parametrization: mup``, base width = the smallest width), and report
where the best learning rate lands per width.

Under muP the best learning rate should stay within one grid step across widths (Yang et al. 2022, "Tensor
Programs V", fig. 1); under standard parametrization it drifts (down, with width).

Corpus: WikiText-2 from the shared data (``lm/wikitext-2``): a byte-level BPE of ``--vocab`` tokens
(``pretrain.datamodules.tokenizer.train_bpe``) trained on ``valid.txt``, which also trains; ``test.txt`` scores.
Without the shared data the benchmark says so and exits 0. Each run: the backbone
(``pretrain.models.transformer``, ``--layers`` pre-norm GPT-2 blocks, head dim 32, untied head) and the run's
optimizer (``pretrain.optim.build_optimizer``, AdamW, weight decay 0), ``--steps`` steps of random
``--context``-token windows, batch ``--batch``, linear warmup over 10 % then linear decay to 0, clipping at 1;
the score is the held-out loss (nats/token) over 128 fixed windows. The learning rates of a width run in
increasing order and stop once ``--rise`` of them past the best were worse (the minimum is bracketed; not run:
NaN). Results go to ``--json`` after every run (a rerun with the same file skips what it holds) and to the plot.

    python benchmarks/bench_mup_transfer.py --data ../shared/data [--widths 64,128,256,512]
        [--lrs ...] [--steps 200] [--json out.json] [--plot docs/mup_transfer.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.config import OptimConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))


def corpus(data: Path, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """WikiText-2 valid (train) and test (held out) as BPE token ids."""
    from pretrain.datamodules.tokenizer import train_bpe

    root = data / "lm" / "wikitext-2"
    tokenizer = train_bpe(root / "valid.txt", vocab, special_tokens=[], show_progress=False)

    def encode(path: Path) -> np.ndarray:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        return np.concatenate([np.array(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(lines)])

    return encode(root / "valid.txt"), encode(root / "test.txt")


def windows(ids: np.ndarray, n: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    start = rng.integers(0, len(ids) - length - 1, n)
    return torch.from_numpy(np.stack([ids[s : s + length + 1] for s in start]))


def loss_of(model: Transformer, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def train_one(parametrization: str, width: int, lr: float, args, train, val) -> float:
    """Held-out loss after ``args.steps`` AdamW steps at base learning rate ``lr`` (inf if it diverged)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=width,
        n_layer=args.layers,
        n_head=max(1, width // 32),
        max_seq_len=args.context,
        parametrization=parametrization,
        mup_base_width=args.base,
        tie_embeddings=False,
        dropout=0.0,
    )
    model = Transformer(cfg)
    optimizer = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0), width_mult=cfg.width_mult)
    warmup = max(1, args.steps // 10)

    def schedule(s: int) -> float:
        return (s + 1) / warmup if s < warmup else max(0.0, (args.steps - s) / (args.steps - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        loss = loss_of(model, windows(train, args.batch, args.context, rng))
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    model.eval()
    held_out = windows(val, 128, args.context, np.random.default_rng(1))
    with torch.no_grad():
        loss = float(sum(loss_of(model, b) for b in held_out.split(32)) / len(held_out.split(32)))
    return loss if math.isfinite(loss) else math.inf


def best_index(losses: list[float]) -> int:
    return int(np.argmin([x if math.isfinite(x) else np.inf for x in losses]))


def bracketed(losses: list[float], rise: int) -> bool:
    """True once the ``rise`` learning rates after the best so far were all worse (or diverged): the sweep
    stops going up at this width (0: never)."""
    return rise > 0 and bool(losses) and len(losses) - 1 - best_index(losses) >= rise


def summary(results: dict, lrs: list[float]) -> list[str]:
    """Per parametrization: the best LR per width and its spread in grid steps."""
    lines = []
    for parametrization, per_width in results.items():
        best = {int(w): best_index(v) for w, v in per_width.items() if len(v) == len(lrs)}
        if not best:
            continue
        spread = max(best.values()) - min(best.values())
        shown = ", ".join(f"{w}: {lrs[i]:.3g}" for w, i in best.items())
        edge = [w for w, i in best.items() if i in (0, len(lrs) - 1)]
        lines.append(
            f"{parametrization}: best lr per width {{{shown}}}; spread {spread} grid step(s) "
            f"({'within one step' if spread <= 1 else 'drifts'})"
            + (f"; at the grid edge for widths {edge}" if edge else "")
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data directory")
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--lrs", default=",".join(f"{2.0**k:.3g}" for k in range(-11, -5)))
    p.add_argument("--parametrizations", default="standard,mup")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--base", type=int, default=None, help="muP base width (default: the smallest width)")
    p.add_argument(
        "--rise",
        type=int,
        default=2,
        help="stop a width's sweep after this many worse LRs past the best (0: all)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "mup_transfer.png")
    p.add_argument("--json", type=Path, default=None, help="results file, written after every run")
    args = p.parse_args()
    if not (args.data / "lm" / "wikitext-2" / "valid.txt").is_file():
        print(f"skipped: no WikiText-2 under {args.data} (pass --data or set PRETRAIN_SHARED_DATA)")
        return
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    args.base = args.base or widths[0]
    lrs = [float(x) for x in args.lrs.split(",")]
    data: tuple[np.ndarray, np.ndarray] | None = (
        None  # tokenized on the first run (none: summary and plot only)
    )
    saved = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {}
    if saved and saved.get("lrs") != lrs:
        sys.exit(f"{args.json} holds a sweep over other learning rates; pass another --json")
    results = saved.get("results", {})
    seconds = saved.get("seconds", {})
    for width in widths:
        for parametrization in args.parametrizations.split(","):
            losses = results.setdefault(parametrization, {}).setdefault(str(width), [])
            for lr in lrs[len(losses) :]:
                if bracketed(losses, args.rise):
                    losses.append(math.nan)  # not run: the minimum is already bracketed
                    continue
                if data is None:
                    data = corpus(args.data, args.vocab)
                    print(
                        f"WikiText-2: {len(data[0]):,} training / {len(data[1]):,} held-out tokens",
                        flush=True,
                    )
                start, cpu = time.monotonic(), time.process_time()
                losses.append(train_one(parametrization, width, lr, args, *data))
                key = f"{parametrization}/{width}"
                seconds[key] = seconds.get(key, 0.0) + time.monotonic() - start
                print(
                    f"{parametrization:<8} width {width:>4} lr {lr:.3g}: {losses[-1]:.4f}  "
                    f"({time.monotonic() - start:.0f} s, {time.process_time() - cpu:.0f} CPU-s, "
                    f"load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                if args.json:
                    state = {"lrs": lrs, "results": results, "seconds": seconds, "args": vars(args)}
                    args.json.write_text(json.dumps(state, indent=1, default=str))
    for line in summary(results, lrs):
        print(line)
    print(f"wall seconds per width: {json.dumps({k: round(v) for k, v in seconds.items()})}")
    plot(results, lrs, args)


def plot(results: dict, lrs: list[float], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, (parametrization, per_width) in zip(axes[0], results.items(), strict=True):
        for width, losses in per_width.items():
            shown = [x if math.isfinite(x) else np.nan for x in losses]
            line = ax.plot(lrs[: len(shown)], shown, marker="o", ms=3, label=f"d_model {width}")[0]
            if len(losses) == len(lrs):
                i = best_index(losses)
                ax.plot([lrs[i]], [losses[i]], marker="*", ms=12, color=line.get_color())
        ax.set(xscale="log", xlabel="AdamW learning rate", title=parametrization)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out loss (nats/token)")
    fig.suptitle(
        f"WikiText-2, BPE {args.vocab}, {args.layers} layers, {args.steps} steps x {args.batch} x "
        f"{args.context} tokens (star: best lr)",
        fontsize=9,
    )
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
