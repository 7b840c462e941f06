"""``torch.compile`` of the backbone: zero graph breaks in forward + loss + backward for every family x mask
kind x attention backend, and no recompilation when the number of targets varies, counted with dynamo's own
counters (``pretrain.compat.compile.CompileCounts``).

On the CPU, flex_attention has no backward, so training with ``attention=flex`` computes through SDPA on the
dense mask of the same ``mask_mod`` (``pretrain.models.attention``): the flex kernel path itself (BlockMask built
inside the graph, ``flex_attention``) is traced in no-grad forwards here, and trained only on GPUs (the GPU
check's train leg counts its breaks).
"""

from __future__ import annotations

import pytest
import torch

from pretrain.compat.compile import CompileCounts, mark_dynamic
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer
from pretrain.objectives.loss import token_cross_entropy
from pretrain.training.module import TARGET_POSITIONS, PretrainData

FAMILIES = {
    "gpt": {"arch": "decoder"},
    "bert": {"arch": "encoder", "norm_position": "post", "embedding_norm": True, "mlm_head_transform": True,
             "lm_head_bias": True},
    "t5": {"arch": "encoder-decoder", "n_decoder_layer": 1, "norm": "rmsnorm", "norm_bias": False,
           "position": "relative", "attn_scale": "none", "tie_embeddings": False},
}  # fmt: skip
SPARSE = {"attention_window": 16, "attention_global_tokens": 4, "attention_random_blocks": 1,
          "attention_block_size": 16}  # fmt: skip
MASKS = [
    "plain",
    "padding",
    "documents",
    "prefix",
    "sparse",
]  # sparse: sliding window | global | random blocks
CASES = [(f, m) for f in FAMILIES for m in MASKS if m != "prefix" or f == "gpt"]
B, T, V = 2, 64, 128


def model(family: str, mask: str, backend: str) -> Transformer:
    extra = dict(SPARSE) if mask == "sparse" else {}
    if mask == "sparse" and family != "gpt":
        extra["attention_global_token_ids"] = [3]  # encoder tokens global wherever they occur ([CLS])
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layer=2, n_head=2, max_seq_len=T, attention=backend,
                      **FAMILIES[family], **extra)  # fmt: skip
    torch.manual_seed(0)
    m = Transformer(cfg)
    m.check_inputs = False  # as in training: the id range is checked once before
    return m


def batch(family: str, mask: str, seed: int) -> tuple[dict, torch.Tensor]:
    """Inputs of one mask kind (lengths, documents, prefixes and the target count differ with ``seed``), the
    labels at ``target_positions``, marked dynamic as ``PretrainData`` marks them after the transfer."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    x = {"input_ids": ids}
    if mask == "padding":
        real = torch.ones(B, T, dtype=torch.long)
        real[1, T - 5 - seed :] = 0
        x["attention_mask"] = real
        if family == "t5":
            x["decoder_attention_mask"] = real[:, : T // 2].clone()
    if mask == "documents":
        x["document_ids"] = (torch.arange(T)[None] >= 20 + seed).long().expand(B, T).contiguous()
    if mask == "prefix":
        x["prefix_lengths"] = torch.tensor([10 + seed, 20])
    if family == "t5":
        x["decoder_input_ids"] = torch.randint(4, V, (B, T // 2), generator=g)
    labels = torch.randint(0, V, x.get("decoder_input_ids", ids).shape, generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.7] = -100
    x[TARGET_POSITIONS] = (labels.flatten() != -100).nonzero().squeeze(1)
    data = PretrainData.__new__(PretrainData)  # its hook only: no loader behind it, no trainer counting
    data.trainer = None
    x = data.on_after_batch_transfer(x, 0)
    return x, mark_dynamic(labels.flatten()[x[TARGET_POSITIONS]], 0)  # the loss is compiled here too


def loss(m: Transformer, x: dict, labels: torch.Tensor) -> torch.Tensor:
    return token_cross_entropy(m(**x).logits, labels)[0]


@pytest.mark.parametrize(("family", "mask"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_training_step_compiles_without_graph_breaks_or_recompiles(family, mask):
    """Three batches of one kind, each with another number of targets: one graph, no break, no recompile.
    (``attention=flex`` trains through this same SDPA path on the CPU.)"""
    m = model(family, mask, "sdpa")
    counts = CompileCounts()
    step = torch.compile(loss, backend="eager")  # dynamo only: breaks and recompiles are decided there
    for seed in range(3):
        x, labels = batch(family, mask, seed)
        step(m, x, labels).backward()
    assert counts.graph_breaks == 0, counts.graph_break_reasons
    assert counts.recompiles == 0, counts.recompile_reasons
    assert counts.graphs == 1
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_traces_into_one_joint_graph(family):
    """AOTAutograd traces forward + loss + backward (sparse + padded masks, the hardest case) as one graph."""
    mask = "sparse"
    m = model(family, mask, "sdpa")
    counts = CompileCounts()
    step = torch.compile(loss, backend="aot_eager")
    for seed in range(2):
        step(m, *batch(family, mask, seed)).backward()
    assert (counts.graph_breaks, counts.recompiles, counts.graphs) == (0, 0, 1), counts.recompile_reasons


FLEX_CASES = [("gpt", m) for m in MASKS] + [("bert", "sparse"), ("t5", "padding")]  # T5: bias as score_mod


@pytest.mark.parametrize(("family", "mask"), FLEX_CASES, ids=[f"{f}-{m}" for f, m in FLEX_CASES])
def test_flex_kernel_path_compiles_without_graph_breaks_or_recompiles(family, mask):
    """No-grad forwards on the flex kernel path: the BlockMask is built inside the graph (never a cached dict
    lookup, which would guard on the dict and recompile when it fills)."""
    m = model(family, mask, "flex").eval()
    counts = CompileCounts()
    forward = torch.compile(lambda x: m(**x).logits, backend="eager")
    with torch.no_grad():
        for seed in range(2):
            forward(batch(family, mask, seed)[0])
    assert counts.graph_breaks == 0, counts.graph_break_reasons
    assert counts.recompiles == 0, counts.recompile_reasons


def test_without_the_dynamic_mark_a_new_target_count_recompiles():
    """The control: the same step with ``target_positions`` left static recompiles for the second count."""
    m = model("bert", "plain", "sdpa")
    counts = CompileCounts()
    step = torch.compile(loss, backend="eager")
    for seed in range(2):
        x, labels = batch("bert", "plain", seed)
        x[TARGET_POSITIONS] = x[TARGET_POSITIONS].clone()  # fresh tensors: no dynamic mark
        step(m, x, labels.clone()).backward()
    assert counts.recompiles == 1 and "target_positions" in counts.recompile_reasons[0]
