"""Objective preparation speed (raw tokens/s, CPU) next to the reference collators, same batches, same run.

Peers:
- MLM: ``transformers.DataCollatorForLanguageModeling`` — its full ``__call__`` on examples carrying
  ``special_tokens_mask`` (as ``run_mlm.py`` tokenizes them), and its masking core ``torch_mask_tokens``;
- span corruption: a NumPy port of the T5 collator of HF's ``run_t5_mlm_flax.py`` (per-row
  ``random_spans_noise_mask`` in NumPy, sentinel ids, filtering, shift right).

Prints the median over rounds of tokens/s and the ratio ours / peer (> 1: ours is faster).

    python benchmarks/bench_objectives.py [--batch 64] [--seq 512] [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain import objectives
from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, all_special_tokens, sentinel_token
from pretrain.datamodules.tokenizer import TextEncoder

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "recipes" / "data" / "tinyshakespeare.txt"
SENTINELS = 200  # UL2's X denoiser (mean span 3, density 0.5) needs 127 at input 512


def load_tokenizer() -> tuple[Tokenizer, str]:
    """GPT-2's byte-level BPE from the shared data plus this project's special tokens, else a BPE trained on
    the shipped corpus."""
    gpt2 = (
        Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data")) / "tokenizers" / "gpt2"
    )
    if (gpt2 / "vocab.json").is_file():
        tok = Tokenizer(models.BPE.from_file(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(all_special_tokens(SENTINELS))
        return tok, "GPT-2 BPE + special tokens"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000, special_tokens=all_special_tokens(SENTINELS), show_progress=False
    )
    tok.train_from_iterator(CORPUS.read_text().split("\n\n"), trainer)
    return tok, "BPE (8000) trained on the shipped corpus"


def packed_batches(tok: Tokenizer, n: int, batch: int, length: int) -> list[torch.Tensor]:
    """``n`` batches ``(batch, length)`` of the shipped corpus, speeches separated by EOS."""
    eos = tok.token_to_id(DEFAULT_SPECIAL_TOKENS["eos"])
    ids: list[int] = []
    for doc in TextEncoder(tok)(CORPUS.read_text().split("\n\n")):
        ids += [*doc, eos]
    stream = torch.tensor(ids)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(stream) - length, (n, batch), generator=g)
    return [stream[s[:, None] + torch.arange(length)] for s in starts]


class NumpyT5Collator:
    """NumPy port of the span-corruption collator of HF's ``run_t5_mlm_flax.py`` (the benchmark's peer)."""

    def __init__(
        self, noise_density, mean_span, input_length, target_length, pad_id, eos_id, last_sentinel, seed
    ):
        self.noise_density, self.mean_span = noise_density, mean_span
        self.input_length, self.target_length = input_length, target_length
        self.pad_id, self.eos_id, self.last_sentinel = pad_id, eos_id, last_sentinel
        self.rng = np.random.default_rng(seed)

    def __call__(self, input_ids: np.ndarray) -> dict[str, np.ndarray]:
        noise = np.asarray([self.noise_mask(input_ids.shape[1]) for _ in range(input_ids.shape[0])])
        inputs = self.filter(input_ids, self.sentinel_ids(noise.astype(np.int8)))
        labels = self.filter(input_ids, self.sentinel_ids((~noise).astype(np.int8)))
        assert inputs.shape[1] == self.input_length and labels.shape[1] == self.target_length
        decoder_input_ids = np.full_like(labels, self.pad_id)
        decoder_input_ids[:, 1:] = labels[:, :-1]
        return {"input_ids": inputs, "labels": labels, "decoder_input_ids": decoder_input_ids}

    def sentinel_ids(self, mask: np.ndarray) -> np.ndarray:
        """Span starts -> descending sentinel ids, continuations -> -1, others 0."""
        starts = mask - np.roll(mask, 1, axis=-1) * mask
        starts[:, 0] = mask[:, 0]
        ids = np.where(starts != 0, np.cumsum(starts, axis=-1), starts)
        ids = np.where(ids != 0, self.last_sentinel + 1 - ids, 0)
        return ids - (mask - starts)

    def filter(self, input_ids: np.ndarray, sentinel_ids: np.ndarray) -> np.ndarray:
        full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
        kept = full[full >= 0].reshape(input_ids.shape[0], -1)
        return np.concatenate([kept, np.full((input_ids.shape[0], 1), self.eos_id)], axis=-1)

    def noise_mask(self, length: int) -> np.ndarray:
        num_noise = min(max(round(length * self.noise_density), 1), length - 1)
        num_spans = max(round(num_noise / self.mean_span), 1)

        def segmentation(num_items, num_segments):
            first = np.arange(num_items - 1) < num_segments - 1
            self.rng.shuffle(first)
            return np.bincount(np.cumsum(np.pad(first, [[1, 0]])))

        lengths = np.stack(
            [segmentation(length - num_noise, num_spans), segmentation(num_noise, num_spans)], 1
        )
        indicator = np.zeros(length, dtype=np.int8)
        indicator[np.cumsum(lengths.reshape(-1))[:-1]] = 1
        return np.cumsum(indicator) % 2 == 1


def median_rates(fns: dict[str, Callable[[torch.Tensor], object]], batches: list[torch.Tensor], rounds: int):
    """Median over rounds of raw tokens/s of each function over all ``batches``; the functions take turns
    within every round (after one warm-up call) so load on the machine hits them alike."""
    for fn in fns.values():
        fn(batches[0])
    n_tokens = sum(b.numel() for b in batches)
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for b in batches:
                fn(b)
            rates[name].append(n_tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512, help="model input length")
    parser.add_argument("--batches", type=int, default=8, help="batches per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a data-loader worker uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok, tok_name = load_tokenizer()
    print(f"tokenizer: {tok_name} ({tok.get_vocab_size()} ids); batch {args.batch} x input {args.seq}; "
          f"{args.rounds} rounds of {args.batches} batches; torch threads {args.threads}")  # fmt: skip
    rows = []

    # --- MLM vs transformers.DataCollatorForLanguageModeling
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    mlm = objectives.build("mlm", tok)
    raw = packed_batches(tok, args.batches, args.batch, mlm.raw_length(args.seq))
    roles = {f"{role}_token": token for role, token in DEFAULT_SPECIAL_TOKENS.items()}
    extra = [t for t in all_special_tokens(SENTINELS) if t not in DEFAULT_SPECIAL_TOKENS.values()]
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, **roles, additional_special_tokens=extra)
    collator = DataCollatorForLanguageModeling(hf_tok, mlm_probability=0.15, seed=0)
    special = torch.tensor(hf_tok.all_special_ids)
    full = {id(b): torch.nn.functional.pad(b, (1, 1), value=mlm.cls_id) for b in raw}
    for f in full.values():
        f[:, -1] = mlm.sep_id
    examples = {
        id(b): [{"input_ids": r, "special_tokens_mask": torch.isin(r, special).long()} for r in f]
        for b, f in zip(raw, full.values())
    }
    collator.generator = torch.Generator().manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    wwm = objectives.build("mlm", tok, whole_word_mask=True, span_masking=True)
    r = median_rates(
        {
            "ours": lambda b: mlm(b, gen),
            "wwm": lambda b: wwm(b, gen),
            "call": lambda b: collator(examples[id(b)]),
            "core": lambda b: collator.torch_mask_tokens(
                full[id(b)].clone(), torch.isin(full[id(b)], special)
            ),
        },
        raw,
        args.rounds,
    )
    rows += [("mlm", "DataCollatorForLanguageModeling.__call__", r["ours"], r["call"])]
    rows += [("mlm", "DataCollatorForLanguageModeling.torch_mask_tokens", r["ours"], r["core"])]
    rows += [("mlm (whole-word spans)", "DataCollatorForLanguageModeling.__call__", r["wwm"], r["call"])]

    # --- span corruption vs the NumPy T5 collator of run_t5_mlm_flax.py
    span = objectives.build("span_corruption", tok)
    raw = packed_batches(tok, args.batches, args.batch, span.raw_length(args.seq))
    target_length = span(raw[0][:1], gen)["labels"].shape[1]
    peer = NumpyT5Collator(
        0.15,
        3.0,
        args.seq,
        target_length,
        span.pad_id,
        span.eos_id,
        tok.token_to_id(sentinel_token(0)),
        seed=0,
    )
    as_numpy = {id(b): b.numpy() for b in raw}
    r = median_rates(
        {"ours": lambda b: span(b, gen), "peer": lambda b: peer(as_numpy[id(b)])}, raw, args.rounds
    )
    rows += [("span_corruption", "NumPy port of run_t5_mlm_flax collator", r["ours"], r["peer"])]

    # --- the other objectives (no peer)
    for name, opts in [
        ("clm", {}),
        ("prefix_lm", {}),
        ("ul2", {"input_length": args.seq}),
    ]:
        obj = objectives.build(name, tok, **opts)
        raw = packed_batches(tok, args.batches, args.batch, obj.raw_length(args.seq))
        rows.append(
            (name, "-", median_rates({name: lambda b, o=obj: o(b, gen)}, raw, args.rounds)[name], None)
        )

    print(f"\n{'objective':<24} {'tokens/s':>12}  {'peer':<50} {'peer tokens/s':>13} {'ours/peer':>9}")
    for name, peer_name, ours, theirs in rows:
        ratio = f"{ours / theirs:9.2f}" if theirs else f"{'':>9}"
        theirs_s = f"{theirs:13.3g}" if theirs else f"{'':>13}"
        print(f"{name:<24} {ours:12.3g}  {peer_name:<50} {theirs_s} {ratio}")


if __name__ == "__main__":
    main()
