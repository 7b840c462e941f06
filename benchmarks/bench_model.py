"""Backbone speed vs transformers' GPT-2, BERT (MLM) and T5 at the same small CPU config, same weights, one run.

Each peer is a randomly initialised transformers model (dropout 0, its default SDPA attention); ours is
``pretrain.models.hf.from_hf(peer)``, so both compute the same function. Per round and family, ours and the peer are
timed back to back (order alternating) on
- train: forward + cross-entropy + backward + AdamW step (fused, same for both), tokens/s;
- infer: no-grad forward, tokens/s.
Printed: median tokens/s, median ratio ours / peer with the min..max over rounds (> 1: ours is faster), and our
achieved GFLOP/s (``Transformer.flops_per_token``; inference = 1/3 of it) against the measured fp32 matmul peak.
Targets: >= 1.1x in training, >= 1.2x in inference. T5 runs the encoder on T tokens and the decoder on T / 4.
On a machine shared with other jobs, wall-clock ratios swing widely; ``--threads 1 --clock cpu`` times with the
process's CPU time instead, which counts only this process's work.

    python benchmarks/bench_model.py [--rounds 7] [--batch 2] [--seq-len 256] [--steps 1] [--threads N]
                                     [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from pretrain.models.hf import from_hf

L, H, D, V = 4, 4, 256, 8192


def peers(seq_len: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    common = {"vocab_size": V, "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H}
    return {
        "gpt2": transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                **common,
                n_positions=seq_len,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "bert": transformers.BertForMaskedLM(
            transformers.BertConfig(
                **common,
                intermediate_size=4 * D,
                max_position_embeddings=seq_len,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        "t5": transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=V,
                d_model=D,
                d_kv=D // H,
                d_ff=4 * D,
                num_layers=L,
                num_heads=H,
                dropout_rate=0.0,
                decoder_start_token_id=0,
            )
        ),
    }


def batch(name: str, batch_size: int, seq_len: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (batch_size, seq_len), generator=g)
    if name == "t5":
        dec = torch.randint(0, V, (batch_size, seq_len // 4), generator=g)
        return {"input_ids": ids, "decoder_input_ids": dec}, dec
    return {"input_ids": ids}, ids


def logits_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).logits


def make_steps(model: torch.nn.Module, inputs: dict, labels: torch.Tensor) -> dict[str, Callable[[], None]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def train() -> None:
        model.train()
        loss = F.cross_entropy(logits_of(model, inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def infer() -> None:
        model.eval()
        logits_of(model, inputs)

    return {"train": train, "infer": infer}


def timed(fn: Callable[[], None], steps: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(steps):
        fn()
    return (clock() - start) / steps


def matmul_peak_gflops(clock: Callable[[], float], n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = min(timed(lambda: a @ b, reps, clock) for _ in range(3))
    return 2 * n**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    B, T = args.batch, args.seq_len
    peak = matmul_peak_gflops(clock)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
        f"{args.clock} clock"
    )
    print(f"config: L={L} h={H} d={D} V={V} T={T} B={B}; fp32 matmul peak {peak:.1f} GFLOP/s\n")

    cases = {}  # (family, mode) -> {"ours": step, "peer": step}
    flops = {}
    for name, peer in peers(T).items():
        ours = from_hf(peer)
        ours.check_inputs = False  # the peer does not validate ids either
        inputs, labels = batch(name, B, T)
        dec_len = labels.shape[1] if name == "t5" else None
        flops[name] = ours.flops_per_token(T, dec_len) * T * B  # one training step
        steps = {"ours": make_steps(ours, inputs, labels), "peer": make_steps(peer, inputs, labels)}
        for mode in ("train", "infer"):
            for who in steps:
                steps[who][mode]()  # warm-up
            cases[name, mode] = {who: steps[who][mode] for who in steps}

    times = {key: {"ours": [], "peer": []} for key in cases}
    for r in range(args.rounds):
        for key, fns in cases.items():
            for who in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
                times[key][who].append(timed(fns[who], args.steps, clock))

    print(
        f"{'case':<12}{'ours tok/s':>12}{'peer tok/s':>12}{'ratio':>8}  {'min..max':<12}{'GFLOP/s':>9}{'% peak':>8}"
    )
    for (name, mode), t in times.items():
        tokens = B * T
        ratios = [p / o for o, p in zip(t["ours"], t["peer"], strict=True)]
        ours_s, peer_s = statistics.median(t["ours"]), statistics.median(t["peer"])
        gflops = flops[name] / (1 if mode == "train" else 3) / ours_s / 1e9
        print(
            f"{name + ' ' + mode:<12}{tokens / ours_s:>12.0f}{tokens / peer_s:>12.0f}"
            f"{statistics.median(ratios):>7.2f}x  {min(ratios):.2f}..{max(ratios):.2f}  "
            f"{gflops:>9.1f}{100 * gflops / peak:>7.0f}%"
        )


if __name__ == "__main__":
    main()
