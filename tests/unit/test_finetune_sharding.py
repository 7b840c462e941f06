"""Finetuning data over data-parallel ranks: evaluation shards cover every example once and are padded to equal
lengths (sharded strategies need equal forward passes); training order resumes mid-epoch where it stopped."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pretrain.datamodules.finetune import MarkPadding, PaddedExamples, ShardSampler, TrainOrder


@given(size=st.integers(1, 200), world=st.integers(1, 9))
def test_evaluation_shards_cover_each_example_once_with_equal_lengths(size, world):
    shards = [list(ShardSampler(size, rank, world)) for rank in range(world)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == -(-size // world)
    real = sorted(i for s in shards for i in s if i < size)
    assert real == list(range(size))  # padding positions are >= size


def test_padding_is_marked_and_collated_like_real_examples():
    examples = PaddedExamples([("a",), ("b",), ("c",)])
    batch = MarkPadding(lambda rows: {"rows": [r[0] for r in rows]})([examples[1], examples[3], examples[2]])
    assert batch["rows"] == ["b", "a", "c"]  # the padding stands in with a real example's content
    assert batch["real"].tolist() == [True, False, True]


@given(size=st.integers(2, 100), world=st.integers(1, 4), epoch=st.integers(0, 3), data=st.data())
def test_training_order_resumes_at_any_position(size, world, epoch, data):
    order = TrainOrder(size, rank=world - 1, world_size=world, seed=7)
    order.set_position(epoch, 0)
    whole = list(order)
    start = data.draw(st.integers(0, len(whole)))
    order.set_position(epoch, start)
    assert list(order) == whole[start:] and len(order) == len(whole)


def test_training_order_is_the_distributed_sampler_permutation():
    """Global batch t of W ranks with micro-batch b holds batch t of one rank with batch W b."""
    one = TrainOrder(64, 0, 1, seed=3)
    two = [TrainOrder(64, r, 2, seed=3) for r in range(2)]
    for o in (one, *two):
        o.set_position(2, 0)
    assert sorted(list(two[0])[:4] + list(two[1])[:4]) == sorted(list(one)[:8])
    assert torch.tensor(list(one)).unique().numel() == 64
