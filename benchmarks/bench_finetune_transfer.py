"""Pretraining transfers: a tiny BERT pretrained with our MLM recipe, then finetuned on SST-2, vs the same
architecture finetuned from random initialisation (same tokenizer, data order, steps and seed).

Pretraining is ``recipes/bert-tiny.yaml`` (masked LM) with its corpus swapped for the *unlabelled* SST-2 training
sentences (labels are never read; task-adaptive pretraining, Gururangan et al. 2020), run through the ``pretrain``
command (tokenizer -> prepare -> fit). Finetuning is ``recipes/finetune-sst2-bert-tiny.yaml`` twice: from the
checkpoint, and from ``init.model`` = the checkpoint's ModelConfig with random weights. Prints full-dev accuracy of
both and their difference. ~10-15 minutes on 2 CPU cores::

    python benchmarks/bench_finetune_transfer.py [--pretrain-steps 1000] [--finetune-steps 600] [--finetune-lr 1e-4]
    python benchmarks/bench_finetune_transfer.py --reuse --finetune-lr 1e-4   # finetuning again only
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pretrain import cli
from pretrain.checkpoint import payload
from pretrain.datamodules.finetune import read_table
from pretrain.finetuning.config import load_config
from pretrain.finetuning.run import run
from pretrain.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--finetune-steps", type=int, default=600)
    parser.add_argument("--finetune-lr", type=float, default=None, help="default: the recipe's optim.lr")
    parser.add_argument("--out", default="runs/bench-transfer")
    parser.add_argument(
        "--reuse", action="store_true", help="reuse the pretrained checkpoint of an earlier run"
    )
    args = parser.parse_args()
    data = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    _, rows = read_table(data / "cls/glue/SST-2/train.tsv")
    corpus = out / "sst2-train-sentences.txt"  # one document per sentence; no labels
    corpus.write_text("\n\n".join(row["sentence"].strip() for row in rows) + "\n")
    overrides = [
        f"run_dir={out / 'mlm'}",
        "resume=null",
        f"trainer.max_steps={args.pretrain_steps}",
        f"tokenizer.path={out / 'tokenizer.json'}",
        f"tokenizer.train_files=[{corpus}]",
        f"data.sources.0.text=[{corpus}]",
        f"data.sources.0.prepared={out / 'prepared'}",
        "logger.wandb.enabled=false",
        "trainer.progress_bar=false",
        "checkpoint.save_top_k=0",
        "trainer.val_check_interval=500",
    ]
    ckpt = out / "mlm" / "checkpoints" / "last.ckpt"
    start = time.perf_counter()
    if not (args.reuse and ckpt.is_file()):
        for command in ("tokenizer", "prepare", "fit"):
            if cli.main([command, "recipes/bert-tiny.yaml", *overrides]) != 0:
                raise SystemExit(f"pretrain {command} failed")
    pretrain_s = time.perf_counter() - start

    results = {}
    for init in ("pretrained", "random"):
        cfg = load_config(
            REPO / "recipes/finetune-sst2-bert-tiny.yaml",
            [
                f"init.checkpoint={ckpt}",
                f"run_dir={out / init}",
                f"trainer.max_steps={args.finetune_steps}",
                "trainer.progress_bar=false",
                "save=false",
                *([f"optim.lr={args.finetune_lr}"] if args.finetune_lr else []),
            ],
        )
        if init == "random":
            cfg.init.model = ModelConfig(**payload(ckpt)["config"]["model"])
            cfg.init.checkpoint, cfg.init.tokenizer = None, str(out / "tokenizer.json")
        results[init] = run(cfg)

    print(
        f"\nMLM pretraining: {args.pretrain_steps} steps on unlabelled SST-2 sentences, {pretrain_s:.0f} s; "
        f"finetuning lr {cfg.optim.lr}"
    )
    print(f"{'init':<12}{'steps':>7}{'train s':>9}{'dev acc':>9}")
    for init, r in results.items():
        print(f"{init:<12}{r['steps']:>7}{r['train_seconds']:>9.0f}{r['val']['accuracy']:>9.4f}")
    gain = results["pretrained"]["val"]["accuracy"] - results["random"]["val"]["accuracy"]
    print(f"transfer: pretrained - random = {gain:+.4f} dev accuracy")


if __name__ == "__main__":
    main()
