"""Objectives pay only for their targets: BERT MLM train step with the LM head (transform + decoder) on the
masked positions only, vs transformers' ``BertForMaskedLM`` (which runs it on every position), same weights.

Per round, back to back (order alternating), one training step (forward, loss, backward, fused AdamW step) of
- ``peer``: ``BertForMaskedLM(input_ids, labels=labels).loss`` (labels -100 off target);
- ``ours``: ``from_hf(peer)`` with ``target_positions`` = the masked positions (what ``pretrain fit`` runs);
- ``ours-all``: the same model with the head on every position (the computation before this change);
- ``prefix-lm`` (no peer: transformers has no prefix LM): a decoder of the same size whose labels cover the
  suffix after a uniform split, head on the suffix vs on every position.
Printed: median tokens/s and the median per-round ratio (min..max). Target: ours >= 1.3x BertForMaskedLM.

    python benchmarks/bench_sparse_targets.py [--rounds 7] [--batch 4] [--seq-len 256] [--vocab 30522]
                                              [--mlm-probability 0.15] [--threads 1] [--clock cpu]

Span corruption is not here: its decoder targets are dense (every decoder position but the padding predicts a
token), so there is nothing to gather; UL2 and the encoder-decoder prefix LM gather the same way (their targets
are padded with -100 to ``target_length``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from pretrain.models.config import ModelConfig
from pretrain.models.hf import from_hf
from pretrain.models.transformer import Transformer

L, H, D = 4, 4, 256


def bert_peer(vocab: int, seq_len: int) -> transformers.BertForMaskedLM:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=D,
        num_hidden_layers=L,
        num_attention_heads=H,
        intermediate_size=4 * D,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def train_step(model: torch.nn.Module, loss_fn) -> callable:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()

    def step() -> None:
        loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def ours_loss(model: Transformer, inputs: dict, labels: torch.Tensor, gather: bool):
    """Mean cross-entropy over the labelled positions, the head on those only (gather) or on all."""
    if gather:
        positions = (labels.flatten() != -100).nonzero().squeeze(1)  # the datamodule finds these on the CPU
        return lambda: F.cross_entropy(
            model(**inputs, target_positions=positions).logits, labels.flatten()[positions]
        )
    return lambda: F.cross_entropy(model(**inputs).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--vocab", type=int, default=30522, help="BERT-base's WordPiece vocabulary by default"
    )
    parser.add_argument("--mlm-probability", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    B, T, V = args.batch, args.seq_len, args.vocab
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    masked = torch.rand(B, T, generator=g) < args.mlm_probability
    mlm_labels = ids.masked_fill(~masked, -100)

    peer = bert_peer(V, T)
    ours, ours_all = from_hf(peer), from_hf(peer)
    for model in (ours, ours_all):
        model.check_inputs = False
    inputs = {"input_ids": ids}
    steps = {
        "bert peer": train_step(peer, lambda: peer(input_ids=ids, labels=mlm_labels).loss),
        "bert ours": train_step(ours, ours_loss(ours, inputs, mlm_labels, gather=True)),
        "bert ours-all": train_step(ours_all, ours_loss(ours_all, inputs, mlm_labels, gather=False)),
    }
    split = torch.randint(1, T - 1, (B,), generator=g)
    suffix_labels = ids.roll(-1, dims=1).masked_fill(torch.arange(T) < split[:, None] - 1, -100)
    decoder = ModelConfig(
        arch="decoder", vocab_size=V, d_model=D, n_layer=L, n_head=H, d_ff=4 * D, max_seq_len=T
    )
    prefix_inputs = {"input_ids": ids, "prefix_lengths": split}
    for name, gather in (("prefix-lm ours", True), ("prefix-lm ours-all", False)):
        torch.manual_seed(0)
        model = Transformer(decoder)
        model.check_inputs = False
        steps[name] = train_step(model, ours_loss(model, prefix_inputs, suffix_labels, gather))

    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in steps if r % 2 == 0 else reversed(steps):
            start = clock()
            steps[name]()
            times[name].append(clock() - start)

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
        f"{args.clock} clock; L={L} d={D} V={V} B={B} T={T}; MLM targets {int(masked.sum())}/{B * T}, "
        f"prefix-LM targets {int((suffix_labels != -100).sum())}/{B * T}\n"
    )
    print(f"{'case':<30}{'tokens/s':>10}{'ratio':>8}  min..max")
    for name, against in (
        ("bert ours", "bert peer"),
        ("bert ours-all", "bert peer"),
        ("bert ours", "bert ours-all"),
        ("prefix-lm ours", "prefix-lm ours-all"),
    ):
        ratios = [p / o for o, p in zip(times[name], times[against], strict=True)]
        print(
            f"{name + ' vs ' + against.split()[-1]:<30}{B * T / statistics.median(times[name]):>10.0f}"
            f"{statistics.median(ratios):>7.2f}x  {min(ratios):.2f}..{max(ratios):.2f}"
        )


if __name__ == "__main__":
    main()
