"""Context parallelism (``pretrain.parallel.context``) equals one process: 2 gloo ranks, each holding half of every
sequence (load-balanced chunks), give the logits, summed loss and gradients of the whole batch in one process --
causal GPT (learned positions) and Llama (RoPE, GQA) under a plain causal mask (the mask-free chunked attention,
``attention.ChunkCausal``); block by block with each block's slice of the mask (``attention.BlockMasked``): GPT
within packed documents (the default GPT recipe's mask), Llama-style RoPE at packed-document positions with GQA and
a sliding window, the prefix LM, BERT (bidirectional, key padding, a global token, segment ids, MLM targets on
labelled positions only), the last three again with blocks of 3 queries reading only the keys they can reach; T5
on the dense mask (encoder and decoder split, cross-attention against the gathered encoder, relative bias at global
positions, a decoder length padded to whole chunks). One launch (``context_parallel_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_utils import run_ranks

WORKER = Path(__file__).parents[1] / "context_parallel_worker.py"
BLOCKED = ("gpt-documents", "gpt-documents-window", "prefix-lm", "bert")  # attention.BlockMasked
SMALL_BLOCKS = ("gpt-documents-window-small-blocks", "prefix-lm-small-blocks", "bert-small-blocks")
CASES = ("gpt", "llama-gqa", *BLOCKED, *SMALL_BLOCKS, "t5")
MASK_FREE = {"gpt", "llama-gqa"}  # plain causal: attention.ChunkCausal, no dense mask


@pytest.fixture(scope="module")
def model_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp-model")
    run_ranks(WORKER, str(out), world_size=2, log_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_model_equals_one_process(model_results, case):
    for rank, results in enumerate(model_results):
        r = results[case]
        assert r["missing_grads"] == 0
        assert r["logits"] < 1e-5, (rank, r)
        assert r["loss"] < 1e-5, (rank, r)
        assert r["grads"] < 1e-5, (rank, r)  # every parameter, the ranks' gradients summed
        # 2 layers x 2 query chunks per rank where the mask is plain causal; 2 layers block by block for any other
        # self-attention mask; T5 (relative bias) on the dense mask
        assert r["mask_free_calls"] == (4 if case in MASK_FREE else 0), (rank, r)
        assert r["block_calls"] == (2 if case in BLOCKED + SMALL_BLOCKS else 0), (rank, r)
