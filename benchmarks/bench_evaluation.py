"""Evaluation speed vs lm-evaluation-harness's ``hf`` model on the same exported weights, in one run.

A random GPT-2-shaped model of ours is exported with ``pretrain.models.hf.save_hf`` (plus a BPE tokenizer trained on
the shipped corpus); lm-eval's ``HFLM`` loads that directory, our ``LMScorer`` loads it through ``from_hf``.
Both score the same requests back to back (order alternating per round):
- loglikelihood: 2-shot multiple-choice requests built from Shakespeare lines (context, " " + choice);
- loglikelihood_rolling: documents longer than the context window (rolling windows).
Printed: median requests/s of each, ratio ours / lm-eval with min..max over rounds (> 1: ours is faster), and
the largest per-request log-likelihood difference (a sanity check: the numbers must agree). ``--clock cpu``
times with this process's CPU time, steadier on a machine shared with other jobs.

    python benchmarks/bench_evaluation.py [--rounds 3] [--requests 256] [--batch 16] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.models import load_scorer
from pretrain.evaluation.perplexity import loglikelihood_rolling
from pretrain.models.config import ModelConfig
from pretrain.models.hf import save_hf
from pretrain.models.transformer import Transformer

CORPUS = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tinyshakespeare.txt"


def export(directory: Path, seq_len: int) -> Path:
    import transformers

    tokenizer = train_bpe(CORPUS, 2048, special_tokens=["<pad>", "<s>", "</s>"])
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", vocab_size=2048, d_model=256, n_layer=4, n_head=4, max_seq_len=seq_len)
    save_hf(Transformer(cfg), directory)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)
    return directory


def requests(n: int) -> tuple[list[tuple[str, str]], list[str]]:
    rng = random.Random(0)
    text = CORPUS.read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) >= 5]
    pairs = []
    for _ in range(n):
        shots = "".join(f"{rng.choice(lines)} {rng.choice(lines)}\n\n" for _ in range(2))
        pairs.append((shots + rng.choice(lines), " " + " ".join(rng.choice(lines).split()[:6])))
    docs = [text[i * 5000 : i * 5000 + 4000] for i in range(max(2, n // 64))]
    return pairs, docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory() as tmp:
        directory = export(Path(tmp), args.seq_len)
        theirs = HFLM(pretrained=str(directory), batch_size=args.batch, device="cpu", dtype="float32")
        ours = load_scorer(directory, batch_size=args.batch)
    pairs, docs = requests(args.requests)

    def ll_instances(kind: str, items: list) -> list:
        return [Instance(request_type=kind, doc={}, arguments=item, idx=0) for item in items]

    workloads = {
        "loglikelihood": (
            len(pairs),
            lambda: [ll for ll, _ in ours.loglikelihood(pairs)],
            lambda: [
                ll for ll, _ in theirs.loglikelihood(ll_instances("loglikelihood", pairs), disable_tqdm=True)
            ],
        ),
        "loglikelihood_rolling": (
            len(docs),
            lambda: [ll for ll, _ in loglikelihood_rolling(ours, docs)],
            lambda: theirs.loglikelihood_rolling(
                ll_instances("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True
            ),
        ),
    }
    torch.set_grad_enabled(False)
    print(
        f"GPT-2 shape d=256 L=4 V=2048 T<={args.seq_len}, batch {args.batch}, {args.rounds} rounds, "
        f"{args.clock} clock, {torch.get_num_threads()} threads"
    )
    for name, (count, run_ours, run_theirs) in workloads.items():
        speeds: dict[str, list[float]] = {"ours": [], "lm-eval": []}
        diff = 0.0
        for r in range(args.rounds):
            order = [("ours", run_ours), ("lm-eval", run_theirs)]
            results = {}
            for who, fn in order if r % 2 == 0 else order[::-1]:
                start = clock()
                results[who] = fn()
                speeds[who].append(count / (clock() - start))
            diff = max(
                diff, max(abs(a - b) for a, b in zip(results["ours"], results["lm-eval"], strict=True))
            )
        ratios = [a / b for a, b in zip(speeds["ours"], speeds["lm-eval"], strict=True)]
        print(
            f"{name:22s} ours {statistics.median(speeds['ours']):8.1f} req/s   lm-eval "
            f"{statistics.median(speeds['lm-eval']):8.1f} req/s   ratio {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}..{max(ratios):.2f})   max |d ll| {diff:.2e}"
        )


if __name__ == "__main__":
    main()
