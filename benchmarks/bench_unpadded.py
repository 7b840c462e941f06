"""Unpadded (packed) vs padded batches, in one run, interleaved rounds (ABBA), medians; prints the ratios.

1. Finetuning step (``data.unpadded``): the BERT-tiny model (``configs/model/bert-tiny.yaml``) with a sequence head
   on GLUE SST-2 training sentences in shuffled micro-batches of 32 (SST-2's short phrases: ~50 % of a padded
   batch is padding), a BPE of 1,024 tokens trained on them; forward, cross-entropy, backward and AdamW per step,
   the same batches padded (``PaddingCollate``) and packed (``PackedCollate``).
2. Evaluation (``unpadded`` scorer): a random GPT-shaped decoder (d 256, 4 layers) scoring ARC-Easy's
   multiple-choice requests (question, " " + choice) with lm-eval's batching, padded and packed; the largest
   log-likelihood difference is printed as a check.

``--clock cpu`` times with this process's CPU time (the work done), steadier on a machine shared with other jobs.

    python benchmarks/bench_unpadded.py [--data ../shared/data] [--rounds 6] [--steps 8] [--requests 400]
        [--clock wall|cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pretrain.datamodules.finetune import FinetuneDataModule, PackedCollate, PaddingCollate
from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.models import scorer_from_model
from pretrain.models.config import ModelConfig
from pretrain.models.heads import Packing, TaskModel
from pretrain.models.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def sst2_batches(data: Path, steps: int, batch: int) -> tuple[list[list], int]:
    """``steps`` shuffled micro-batches of SST-2 training examples and the tokenizer's vocabulary size."""
    train = data / "cls/glue/SST-2/train.tsv"
    with tempfile.TemporaryDirectory() as tmp:
        sentences = Path(tmp) / "sst2.txt"
        lines = train.read_text(encoding="utf-8").splitlines()[1:]
        sentences.write_text("\n".join(line.split("\t")[0] for line in lines), encoding="utf-8")
        tokenizer = train_bpe(sentences, 1024, document="line", show_progress=False)
    module = FinetuneDataModule(tokenizer, train, task="sst2", max_length=64, micro_batch_size=batch)
    module.setup("fit")
    examples = module.examples["train"]
    order = random.Random(0).sample(range(len(examples)), steps * batch)
    return [[examples[i] for i in order[s * batch : (s + 1) * batch]] for s in range(steps)], 1024


def finetune_step_times(batches: list[list], rounds: int) -> dict[str, list[float]]:
    cfg = ModelConfig(**{**_yaml(REPO / "configs/model/bert-tiny.yaml"), "dropout": 0.0, "attn_dropout": 0.0})
    torch.manual_seed(0)
    model = TaskModel(Transformer(cfg), "sequence", 2, pooling="first", dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    collated = {
        "padded": [PaddingCollate(0, False)(b) for b in batches],
        "unpadded": [PackedCollate(0, False)(b) for b in batches],
    }
    for name, items in collated.items():
        real = sum(int(b["attention_mask"].sum()) for b in items)
        computed = sum(b["input_ids"].numel() for b in items)
        print(
            f"  {name}: {computed} positions computed for {real} tokens ({1 - real / computed:.1%} padding)"
        )

    def run(name: str) -> float:
        start = clock()
        for batch in collated[name]:
            logits = model(
                batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], Packing.of(batch)
            )
            torch.nn.functional.cross_entropy(logits, batch["labels"]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (clock() - start) / len(collated[name])

    run("padded"), run("unpadded")  # warm-up
    return interleaved(run, ("padded", "unpadded"), rounds)


def evaluation_rates(data: Path, n: int, rounds: int) -> tuple[dict[str, list[float]], float]:
    docs = [json.loads(line) for line in (data / "icl/llmfoundry/arc_easy.jsonl").read_text().splitlines()]
    pairs = [(d["query"], " " + choice) for d in docs for choice in d["choices"]][:n]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "arc.txt"
        text.write_text("\n".join(q + c for q, c in pairs), encoding="utf-8")
        tokenizer = train_bpe(
            text, 2048, special_tokens=["<pad>", "<s>", "</s>"], document="line", show_progress=False
        )
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(arch="decoder", vocab_size=2048, d_model=256, n_layer=4, n_head=4, max_seq_len=256)
    )
    scorers = {
        name: scorer_from_model(model, tokenizer, batch_size=16, unpadded=name == "unpadded")
        for name in ("padded", "unpadded")
    }
    requests = scorers["padded"].encode_requests(pairs)
    results = {}

    def run(name: str) -> float:
        start = clock()
        results[name] = scorers[name].loglikelihood_tokens(requests)
        return len(requests) / (clock() - start)

    run("padded"), run("unpadded")  # warm-up
    rates = interleaved(run, ("padded", "unpadded"), rounds)
    diff = max(abs(a - b) for (a, _), (b, _) in zip(results["padded"], results["unpadded"], strict=True))
    return rates, diff


def interleaved(run, names: tuple[str, str], rounds: int) -> dict[str, list[float]]:
    """``run(name)`` per round, in ABBA order."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(run(name))
    return out


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared/data"))
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no OpenMP contention on a busy CPU)"
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    print(f"load {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads, {args.clock} clock")
    print("finetuning step (BERT-tiny, SST-2, micro-batch 32):")
    batches, _ = sst2_batches(args.data, args.steps, 32)
    times = finetune_step_times(batches, args.rounds)
    padded, unpadded = (statistics.median(times[k]) for k in ("padded", "unpadded"))
    print(
        f"  step: padded {padded * 1e3:.1f} ms, unpadded {unpadded * 1e3:.1f} ms: "
        f"**{padded / unpadded:.2f}x** (rounds {min(p / u for p, u in zip(times['padded'], times['unpadded'])):.2f}"
        f"..{max(p / u for p, u in zip(times['padded'], times['unpadded'])):.2f})"
    )
    print(f"evaluation (decoder d 256 x 4, ARC-Easy, {args.requests} requests, batch 16):")
    rates, diff = evaluation_rates(args.data, args.requests, args.rounds)
    padded, unpadded = (statistics.median(rates[k]) for k in ("padded", "unpadded"))
    print(
        f"  padded {padded:.1f} requests/s, unpadded {unpadded:.1f} requests/s: **{unpadded / padded:.2f}x**; "
        f"largest log-likelihood difference {diff:.1e}"
    )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
