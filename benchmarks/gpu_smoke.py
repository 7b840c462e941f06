"""GPU smoke run of the GPT-2 124M recipe: bf16 + torch.compile + FlashAttention for ~200 steps, then DeepSpeed
ZeRO-2 and FSDP for 20 steps each; prints tokens/s and MFU of each (skips cleanly without a CUDA GPU).

    bash benchmarks/gpu_smoke.sh [--steps 200] [--sharded-steps 20] [--micro-batch 16]

Data: the shipped Tiny Shakespeare, tokenized with GPT-2's BPE when ``$PRETRAIN_SHARED_DATA/tokenizers/gpt2``
exists, else with a BPE trained here. Each run is a separate ``pretrain fit`` process (outputs under
``runs/gpu_smoke/``); the compiled run forces PyTorch's FlashAttention kernel, so it fails loudly if attention
would fall back to another kernel. The FSDP run writes a sharded checkpoint, which is then consolidated and
exported to a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK = REPO_ROOT / "runs" / "gpu_smoke"
CORPUS = REPO_ROOT / "recipes" / "data" / "tinyshakespeare.txt"


def tokenizer_overrides() -> list[str]:
    """GPT-2's tokenizer if the shared data has it, else a BPE trained on the corpus; then the prepared data."""
    from datamodules.prepare import prepare
    from datamodules.tokenizer import train_bpe

    gpt2 = (
        Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
        / "tokenizers"
        / "gpt2"
    )
    if (gpt2 / "vocab.json").is_file() and (gpt2 / "merges.txt").is_file():
        tokenizer, extra = gpt2, ["tokenizer.special_tokens.eos=<|endoftext|>"]
    else:
        tokenizer, extra = WORK / "tokenizer.json", []
        if not tokenizer.is_file():
            train_bpe([CORPUS], 8192, tokenizer, show_progress=False)
    prepare([CORPUS], tokenizer, WORK / "data", val_fraction=0.05, progress=False)
    return [f"tokenizer.path={tokenizer}", f"data.sources.0.prepared={WORK / 'data'}", *extra]


def run(name: str, overrides: list[str], flash: bool) -> Path:
    run_dir = WORK / name
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "flash" if flash else "any",
        "fit",
        str(REPO_ROOT / "recipes" / "gpt2-124m.yaml"),
        f"run_dir={run_dir}",
        "resume=null",
        *overrides,
    ]
    print(f"\n=== {name}: {' '.join(cmd[4:])}", flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return run_dir


def last_metrics(run_dir: Path) -> dict[str, float]:
    """The last logged value of every metric of the run's newest launch."""
    newest = max((run_dir / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    out = {}
    with open(newest / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            out.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sharded-steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU here; nothing to do")
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    devices = torch.cuda.device_count()
    common = tokenizer_overrides() + [
        f"trainer.devices={devices}",
        "trainer.precision=bf16-mixed",
        f"data.micro_batch_size={args.micro_batch}",
        "trainer.accumulate_grad_batches=1",
        "optim.warmup_steps=20",
        "trainer.val_check_interval=100000",
        "trainer.limit_val_batches=2",
        "checkpoint.every_n_steps=100000",
        "checkpoint.save_top_k=0",
        "logger.wandb.enabled=false",
        "trainer.log_every_n_steps=10",
        "trainer.throughput_window=10",
        "trainer.progress_bar=false",
    ]
    ddp = "strategy.name=ddp" if devices > 1 else "strategy.name=auto"
    results = {
        "bf16 + compile + flash": run(
            "compile", [*common, ddp, "trainer.compile=true", f"trainer.max_steps={args.steps}"], flash=True
        )
    }
    if importlib.util.find_spec("deepspeed") is None:
        print("\n=== deepspeed ZeRO-2: skipped (pip install deepspeed)")
    else:
        results["DeepSpeed ZeRO-2"] = run(
            "zero2",
            [
                *common,
                "strategy.name=deepspeed",
                "strategy.deepspeed.stage=2",
                "trainer.compile=false",
                f"trainer.max_steps={args.sharded_steps}",
            ],
            flash=False,
        )
    results["FSDP"] = run(
        "fsdp",
        [*common, "strategy.name=fsdp", "trainer.compile=false", f"trainer.max_steps={args.sharded_steps}"],
        flash=False,
    )
    from pretrain.cli import main as pretrain_main

    sharded = WORK / "fsdp" / "checkpoints" / "last.ckpt"
    assert sharded.is_dir(), f"FSDP should have written a sharded checkpoint directory at {sharded}"
    assert pretrain_main(["export", str(sharded), str(WORK / "fsdp" / "hf")]) == 0

    print(
        f"\n{'run':<26}{'tokens/s (per GPU)':>20}{'MFU':>8}{'final loss':>12}   ({torch.cuda.get_device_name()})"
    )
    for name, run_dir in results.items():
        m = last_metrics(run_dir)
        mfu = f"{100 * m['train/device/mfu']:.1f}%" if "train/device/mfu" in m else "n/a"
        print(
            f"{name:<26}{m.get('train/device/items_per_sec', float('nan')):>20,.0f}{mfu:>8}"
            f"{m.get('train/loss', float('nan')):>12.3f}"
        )
    return 0


def child(kernel: str, argv: list[str]) -> int:
    """One ``pretrain`` command, with SDPA restricted to FlashAttention when ``kernel == "flash"``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pretrain.cli import main as pretrain_main

    if kernel == "flash":
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return pretrain_main(argv)
    return pretrain_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
