"""Generation speed vs transformers' ``generate()`` on the same GPT-2 and T5 weights: greedy, sampling and beam
search at batch 1 and 8 (decoder prompts left-padded, T5 sources padded), interleaved in one process.

Each peer is a randomly initialised transformers model (dropout 0); ours is ``pretrain.models.hf.from_hf(peer)``.
EOS is disabled on both sides so every call generates exactly ``--new-tokens`` tokens per row. Per round and case,
ours and the peer run back to back (order alternating); printed: new tokens/s (rows x new tokens / time), the
median per-round ratio ours / peer with min..max (> 1: ours is faster), and whether the outputs are identical
(greedy and beam must be; sampling draws from different generators). Target: >= 1.2x in every case.

    python benchmarks/bench_generation.py [--rounds 5] [--new-tokens 32] [--beams 4] [--threads 1] [--clock cpu]
                                          [--size tiny|small|124m] [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from pretrain.models.beam_search import beam_search
from pretrain.models.generation import generate
from pretrain.models.hf import from_hf

SIZES = {  # (layers, heads, width, vocabulary)
    "tiny": (2, 2, 64, 512),  # gpu_check's CPU mode
    "small": (4, 4, 256, 8192),
    "124m": (12, 12, 768, 50257),
}


def peers(size: str, max_len: int) -> dict[str, torch.nn.Module]:
    L, H, D, V = SIZES[size]
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V,
            n_embd=D,
            n_layer=L,
            n_head=H,
            n_positions=max_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=V,
            d_model=D,
            d_kv=D // H,
            d_ff=4 * D,
            num_layers=L,
            num_heads=H,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=2,
        )
    )
    return {"gpt2": gpt2, "t5": t5}


def prompts(batch: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids in [3, V) and a mask with 0 on the left padding (row lengths 8..24; batch 1: 24 tokens)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, 24), generator=g)
    lengths = torch.randint(8, 25, (batch,), generator=g) if batch > 1 else torch.tensor([24])
    mask = (torch.arange(24) >= 24 - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def cases(name: str, peer, ours, batch: int, args) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """{mode: {"ours": fn, "peer": fn}}, each fn returning the generated sequences (prompt included)."""
    ids, mask = prompts(batch, peer.config.vocab_size, args.device)
    n = args.new_tokens
    hf = {"max_new_tokens": n, "min_new_tokens": n, "pad_token_id": 0, "eos_token_id": None}
    if name == "t5":  # the source feeds the encoder, the decoder starts from decoder_start_token_id
        hf_inputs = {"input_ids": ids.flip(1), "attention_mask": mask.flip(1)}  # right-padded source
        ours_inputs = {
            "input_ids": None,
            "encoder_input_ids": ids.flip(1),
            "encoder_attention_mask": mask.flip(1),
        }
    else:
        hf_inputs = {"input_ids": ids, "attention_mask": mask}
        ours_inputs = {"input_ids": ids, "attention_mask": mask}
    sample = {"top_k": 50, "top_p": 0.95, "temperature": 0.8}
    generator = torch.Generator(args.device).manual_seed(0)
    return {
        "greedy": {
            "ours": lambda: generate(ours, max_new_tokens=n, greedy=True, pad_token_id=0, **ours_inputs),
            "peer": lambda: peer.generate(**hf_inputs, **hf, do_sample=False),
        },
        "sample": {
            "ours": lambda: generate(
                ours, max_new_tokens=n, pad_token_id=0, generator=generator, **sample, **ours_inputs
            ),
            "peer": lambda: peer.generate(**hf_inputs, **hf, do_sample=True, **sample),
        },
        "beam": {
            "ours": lambda: (
                beam_search(
                    ours, max_new_tokens=n, num_beams=args.beams, pad_token_id=0, **ours_inputs
                ).sequences
            ),
            "peer": lambda: peer.generate(**hf_inputs, **hf, do_sample=False, num_beams=args.beams),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return clock() - start

    table = {}  # (family, batch, mode) -> {"ours": fn, "peer": fn}
    same = {}
    for name, peer in peers(args.size, 24 + args.new_tokens).items():
        peer = peer.to(args.device).eval()
        ours = from_hf(peer).to(args.device).eval()
        ours.config.eos_token_id = None
        for batch in args.batches:
            for mode, fns in cases(name, peer, ours, batch, args).items():
                out = {who: fn() for who, fn in fns.items()}  # warm-up, and the outputs compared
                same[name, batch, mode] = out["ours"].shape == out["peer"].shape and torch.equal(
                    out["ours"], out["peer"]
                )
                table[name, batch, mode] = fns
    times = {key: {"ours": [], "peer": []} for key in table}
    with torch.inference_mode():
        for r in range(args.rounds):
            for key, fns in table.items():
                for who in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
                    times[key][who].append(timed(fns[who]))

    device = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}, {args.clock} clock")
    L, H, D, V = SIZES[args.size]
    print(f"models: L={L} h={H} d={D} V={V}; {args.new_tokens} new tokens; beams {args.beams}\n")
    print(f"{'case':<18}{'ours tok/s':>11}{'peer tok/s':>11}{'ratio':>8}  {'min..max':<11}{'identical':>10}")
    results = []
    for (name, batch, mode), t in times.items():
        tokens = batch * args.new_tokens
        ratios = [p / o for o, p in zip(t["ours"], t["peer"], strict=True)]
        row = {
            "model": name,
            "batch": batch,
            "mode": mode,
            "ours_tokens_per_s": tokens / statistics.median(t["ours"]),
            "peer_tokens_per_s": tokens / statistics.median(t["peer"]),
            "ratio": statistics.median(ratios),
            "identical": same[name, batch, mode],
        }
        results.append(row)
        print(
            f"{f'{name} b{batch} {mode}':<18}{row['ours_tokens_per_s']:>11.0f}{row['peer_tokens_per_s']:>11.0f}"
            f"{row['ratio']:>7.2f}x  {min(ratios):.2f}..{max(ratios):<6.2f}{'yes' if row['identical'] else 'no':>10}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "size": args.size, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
