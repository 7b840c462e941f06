"""Context parallelism's layout and data side (``pretrain.parallel.context``): which positions a rank holds, how the
gathered keys are put back in order, how a collated batch is cut."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pretrain.objectives.loss import IGNORE_INDEX
from pretrain.parallel.context import SequenceShard, chunk_positions, natural_order

layouts = st.tuples(st.integers(1, 6), st.integers(1, 8)).map(lambda t: (t[0], 2 * t[0] * t[1]))


@given(layouts)
def test_the_ranks_partition_the_sequence_with_equal_causal_work(layout):
    size, seq_len = layout
    held = [chunk_positions(seq_len, r, size) for r in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    assert {len(h) for h in held} == {seq_len // size}
    causal_pairs = {int((h + 1).sum()) for h in held}  # a query at p reads p + 1 keys
    assert len(causal_pairs) == 1


@given(layouts)
def test_natural_order_puts_the_gathered_positions_in_order(layout):
    size, seq_len = layout
    gathered = torch.cat([chunk_positions(seq_len, r, size) for r in range(size)])
    assert gathered[natural_order(seq_len, size)].tolist() == list(range(seq_len))


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    assert chunk_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_a_length_not_divisible_by_twice_the_ranks_is_refused():
    with pytest.raises(ValueError, match="2 x context_parallel = 4"):
        chunk_positions(6, 0, 2)
    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match="'input_ids' has 6 positions.*data.seq_len"):
        SequenceShard(0, 2)(batch)


def test_the_shard_cuts_per_token_tensors_and_keeps_per_sample_ones():
    ids = torch.arange(16).view(2, 8)
    batch = {"input_ids": ids, "labels": ids + 100, "prefix_lengths": torch.tensor([3, 5])}
    rank1 = SequenceShard(1, 2)(batch)
    assert rank1["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert rank1["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert rank1["prefix_lengths"].tolist() == [3, 5]


def test_masks_that_mask_nothing_are_dropped_on_the_whole_batch():
    """Every rank of a group decides alike: a mask padding only rank 1's positions stays on rank 0 too."""
    mask = torch.ones(1, 8, dtype=torch.long)
    assert "attention_mask" not in SequenceShard(0, 2)({"attention_mask": mask})
    mask[0, 4] = 0  # position 4: rank 1's
    rank0 = SequenceShard(0, 2)({"attention_mask": mask})
    assert rank0["attention_mask"].tolist() == [[1, 1, 1, 1]]


def test_the_decoder_side_is_padded_to_whole_chunks_with_nothing_to_predict():
    batch = {
        "input_ids": torch.ones(1, 8, dtype=torch.long),
        "decoder_input_ids": torch.full((1, 5), 7),
        "decoder_attention_mask": torch.ones(1, 5, dtype=torch.long),
        "labels": torch.full((1, 5), 9),
    }
    batch["decoder_attention_mask"][0, 4] = 0
    ranks = [SequenceShard(r, 2)(batch) for r in range(2)]
    assert [r["decoder_input_ids"].shape[1] for r in ranks] == [4, 4]  # 5 -> 8 positions
    order = natural_order(8, 2)
    labels = torch.cat([r["labels"] for r in ranks], 1)[:, order]
    assert labels.tolist() == [[9] * 5 + [IGNORE_INDEX] * 3]
    mask = torch.cat([r["decoder_attention_mask"] for r in ranks], 1)[:, order]
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]]
    assert ranks[0]["input_ids"].shape == (1, 4)
