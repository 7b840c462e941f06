"""One rank of ``test_context_parallel.py``'s model check: for every case, the same tiny model (same seed) runs the
whole batch in this process (the reference) and this rank's positions of it under context parallelism over all
ranks (``pretrain.parallel.context``); writes ``<out>/rank<r>.json``: per case, the largest relative difference of
this rank's logits from the reference's at the same positions, of the summed loss, and of every parameter's
gradient (the ranks' gradients summed) from the reference's.

    python tests/context_parallel_worker.py OUT_DIR        (ranks set up by the launcher: RANK, WORLD_SIZE, ...)
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from pretrain.models import attention
from pretrain.models.attention import BlockMasked, ChunkCausal
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.objectives.loss import IGNORE_INDEX, token_cross_entropy
from pretrain.parallel.context import SequenceShard, apply_context_parallel, chunk_positions

V, T = 96, 32
SMALL_BLOCKS = (
    "gpt-documents-window",
    "prefix-lm",
    "bert",
)  # run again with BlockMasked's blocks of 3 queries


def tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(4, V, shape, generator=torch.Generator().manual_seed(seed))


def documents(B: int, eos_every: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """document ids and positions restarting at each document, documents of the given lengths per row."""
    docs = torch.stack([torch.arange(T) // n for n in eos_every])
    starts = torch.stack([torch.arange(T) - torch.arange(T) % n for n in eos_every])
    return docs, torch.arange(T).expand(B, T) - starts


def cases() -> dict[str, tuple[ModelConfig, dict[str, torch.Tensor]]]:
    """(config, whole batch with labels) per case; B = 2."""
    small = {"vocab_size": V, "d_model": 32, "n_layer": 2, "n_head": 4, "max_seq_len": 64}
    ids = tokens((2, T), 0)
    labels = tokens((2, T), 1)
    docs, positions = documents(2, (5, 11))
    prefix = torch.tensor([7, 20])
    out: dict[str, tuple[ModelConfig, dict[str, torch.Tensor]]] = {
        "gpt": (ModelConfig(**small), {"input_ids": ids, "labels": labels}),
        # plain causal with RoPE and GQA: the mask-free chunked attention (attention.ChunkCausal), heads repeated
        "llama-gqa": (
            ModelConfig(**small, position="rope", n_kv_head=2, norm="rmsnorm", norm_bias=False),
            {"input_ids": ids, "labels": labels},
        ),
        # the default GPT recipe's mask: causal within packed documents (BlockMasked)
        "gpt-documents": (ModelConfig(**small), {"input_ids": ids, "labels": labels, "document_ids": docs}),
        # Llama-style: RoPE at document positions, GQA, packed-document mask, sliding window, global-token-free
        "gpt-documents-window": (
            ModelConfig(
                **small,
                position="rope",
                n_kv_head=2,
                norm="rmsnorm",
                norm_bias=False,
                activation="swiglu",
                attention_window=6,
            ),
            {"input_ids": ids, "labels": labels, "document_ids": docs, "position_ids": positions},
        ),
        "prefix-lm": (
            ModelConfig(**small, position="rope"),
            {
                "input_ids": ids,
                "labels": labels.masked_fill(torch.arange(T) < prefix[:, None] - 1, IGNORE_INDEX),
                "prefix_lengths": prefix,
            },
        ),
    }
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 25:] = 0  # padding at the end of row 1
    mlm_labels = torch.where(tokens((2, T), 2) % 7 == 0, labels, IGNORE_INDEX)
    bert = ModelConfig(
        **small,
        arch="encoder",
        norm_position="post",
        embedding_norm=True,
        type_vocab_size=2,
        mlm_head_transform=True,
        lm_head_bias=True,
        init="bert",
        attention_global_tokens=1,
    )
    out["bert"] = (
        bert,
        {
            "input_ids": ids,
            "attention_mask": mask,
            "token_type_ids": (torch.arange(T) >= 16).long().expand(2, T),
            "labels": mlm_labels,
        },
    )
    t5 = ModelConfig(
        **small,
        arch="encoder-decoder",
        n_decoder_layer=2,
        position="relative",
        relative_num_buckets=8,
        relative_max_distance=16,
        norm="rmsnorm",
        norm_bias=False,
        attn_bias=False,
        mlp_bias=False,
        attn_scale="none",
        init="t5",
        tie_embeddings=False,
        activation="relu",
    )
    dec_labels = tokens((2, 13), 3)  # 13 decoder positions: padded to 16 on the data side
    dec_labels[0, 10:] = IGNORE_INDEX
    out["t5"] = (
        t5,
        {
            "input_ids": ids,
            "attention_mask": mask,
            "decoder_input_ids": torch.cat(
                (torch.zeros(2, 1, dtype=torch.long), dec_labels[:, :-1]), 1
            ).clamp(0),
            "labels": dec_labels,
        },
    )
    return out


def sparse_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MLM-style ``target_positions``: the flat indices of the labelled positions (as the training data adds)."""
    if "token_type_ids" in batch:
        batch = {
            **batch,
            "target_positions": (batch["labels"].flatten() != IGNORE_INDEX).nonzero().squeeze(1),
        }
    return batch


def loss_of(model: Transformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, summed token cross entropy)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    if "target_positions" in batch:
        labels = labels.flatten()[batch["target_positions"]]
    logits = model(**inputs).logits
    return logits, token_cross_entropy(logits, labels)[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check(
    config: ModelConfig, batch: dict[str, torch.Tensor], rank: int, world: int, small_blocks: bool = False
) -> dict[str, float]:
    """``small_blocks``: BlockMasked cuts each chunk of 8 queries into blocks of 3, 3 and 2, each reading only
    the key range it can reach."""
    torch.manual_seed(0)
    reference = Transformer(config)
    model = copy.deepcopy(reference)
    logits, loss = loss_of(reference, sparse_targets(batch))
    loss.backward()
    apply_context_parallel(model, dist.group.WORLD)
    local = sparse_targets(SequenceShard(rank, world)(batch))
    sizes = {"BLOCK_ELEMENTS": 1 if small_blocks else attention.BLOCK_ELEMENTS}
    sizes["MIN_BLOCK_QUERIES"] = 3 if small_blocks else attention.MIN_BLOCK_QUERIES
    with (
        mock.patch.object(ChunkCausal, "apply", wraps=ChunkCausal.apply) as chunked,
        mock.patch.object(BlockMasked, "apply", wraps=BlockMasked.apply) as blocked,
        mock.patch.multiple(attention, **sizes),
    ):
        local_logits, local_loss = loss_of(model, local)
        local_loss.backward()
    calls = chunked.call_count
    total = local_loss.detach().clone()
    dist.all_reduce(total)
    for p in model.parameters():
        dist.all_reduce(p.grad)
    if "target_positions" in batch or "token_type_ids" in batch:  # MLM: compare the labelled rows
        positions = chunk_positions(T, rank, world)
        full = torch.full((2, T, V), float("nan"))
        full.view(-1, V)[(batch["labels"].flatten() != IGNORE_INDEX).nonzero().squeeze(1)] = logits.detach()
        expected = full[:, positions].reshape(-1, V)
        expected = expected[~expected.isnan().any(-1)]
    else:
        length = logits.shape[1]
        padded = -length % (2 * world)
        if padded:  # the decoder side, padded on the data side
            logits = torch.cat((logits, logits.new_zeros(logits.shape[0], padded, V)), 1)
        expected = logits[:, chunk_positions(length + padded, rank, world)]
        keep = torch.ones(expected.shape[1], dtype=torch.bool)
        keep[chunk_positions(length + padded, rank, world) >= length] = False
        expected, local_logits = expected[:, keep], local_logits[:, keep]
    largest = max(float(q.grad.abs().max()) for q in reference.parameters() if q.grad is not None)
    # softmax ignores a key bias: its gradient is zero up to rounding, so it is compared to the largest gradient
    grads = {
        name: relative(p.grad, q.grad)
        if not name.endswith("k.bias")
        else float((p.grad - q.grad).abs().max()) / largest
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True)
        if q.grad is not None
    }
    return {
        "logits": relative(local_logits.detach(), expected.detach()),
        "loss": relative(total, loss.detach()),
        "grads": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "missing_grads": sum(p.grad is None for p in reference.parameters()),
        "mask_free_calls": calls,  # attention calls of ChunkCausal (no (T/N x T) mask)
        "block_calls": blocked.call_count,  # attention calls of BlockMasked (a block's mask at a time)
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {name: check(cfg, batch, rank, world) for name, (cfg, batch) in cases().items()}
    for name in SMALL_BLOCKS:
        results[f"{name}-small-blocks"] = check(*cases()[name], rank, world, small_blocks=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
