"""Packing, blending, sharding and resume of the sample stream (pretrain.datamodules.dataset)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrain.datamodules.dataset import (
    BlendedDataset,
    PackedDataset,
    ResumableSampler,
    ShardedSampler,
    blend_schedule,
)

FAST = settings(max_examples=60, deadline=None)


def rank_indices(sampler_cls, epoch_size, batch, world, **kwargs) -> list[list[int]]:
    return [list(sampler_cls(epoch_size, batch, rank=r, world_size=world, **kwargs)) for r in range(world)]


@FAST
@given(n_tokens=st.integers(1, 400), length=st.integers(1, 40))
def test_packed_samples_are_consecutive_non_overlapping_cuts(n_tokens, length):
    tokens = np.arange(n_tokens, dtype=np.uint16)
    if n_tokens < length:
        with pytest.raises(ValueError, match="fewer than one sample"):
            PackedDataset(tokens, length)
        return
    ds = PackedDataset(tokens, length)
    assert len(ds) == n_tokens // length
    samples = [ds[i] for i in range(len(ds))]
    assert all(s.dtype == np.int64 and s.shape == (length,) for s in samples)
    np.testing.assert_array_equal(np.concatenate(samples), tokens[: len(ds) * length])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_too_small_corpus_names_corpus_count_and_length():
    with pytest.raises(ValueError) as err:
        PackedDataset(np.zeros(100, np.uint16), 129, name="data/wiki/train")
    msg = str(err.value)
    assert "data/wiki/train" in msg and "100 tokens" in msg and "129" in msg


@FAST
@given(epoch_size=st.integers(1, 300), batch=st.integers(1, 5), world=st.integers(1, 4))
def test_shards_are_disjoint_equal_and_cover_all_but_the_tail(epoch_size, batch, world):
    if epoch_size < batch * world:
        with pytest.raises(ValueError, match="fewer than one global batch"):
            ShardedSampler(epoch_size, batch, world_size=world)
        return
    per_rank = rank_indices(ShardedSampler, epoch_size, batch, world)
    lengths = {len(x) for x in per_rank}
    assert lengths == {len(ShardedSampler(epoch_size, batch, world_size=world))}
    assert lengths.pop() % batch == 0  # every rank: the same whole number of batches
    flat = [i for x in per_rank for i in x]
    assert len(flat) == len(set(flat))
    assert set(flat) == set(range(len(flat)))  # the epoch's leading positions ...
    assert epoch_size - len(flat) < batch * world  # ... all but a tail shorter than a global batch
    # global batch t is contiguous in the stream: rank r holds its r-th micro-batch
    for r, idx in enumerate(per_rank):
        assert idx[:batch] == list(range(r * batch, (r + 1) * batch))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_epoch_reads_every_sample_once_across_ranks(world):
    batch, n = 2, 60  # 60 samples: divisible by 2*1, 2*2 and 2*3
    ds = BlendedDataset([PackedDataset(np.arange(n * 5), 5)], seed=3)
    seen_per_epoch = []
    for epoch in range(3):
        samplers = [ResumableSampler(n, batch, rank=r, world_size=world, epoch=epoch) for r in range(world)]
        ids = [ds.locate(g)[1] for s in samplers for g in s]
        assert sorted(ids) == list(range(n))
        seen_per_epoch.append(ids)
    assert seen_per_epoch[0] != seen_per_epoch[1] != seen_per_epoch[2]  # reshuffled every epoch


def epoch_order(seed: int, epoch: int = 0) -> list[int]:
    ds = BlendedDataset([PackedDataset(np.arange(400), 4)], seed=seed)
    return [ds.locate(epoch * len(ds) + j)[1] for j in range(len(ds))]


def test_order_depends_on_seed_and_epoch_only():
    assert epoch_order(0) == epoch_order(0)
    assert epoch_order(0, epoch=2) == epoch_order(0, epoch=2)
    assert epoch_order(0) != epoch_order(1)
    assert epoch_order(0) != epoch_order(0, epoch=1)
    assert sorted(epoch_order(5)) == list(range(100))


def test_validation_order_is_fixed():
    ds = BlendedDataset([PackedDataset(np.arange(40), 4)], shuffle=False)
    sampler = ShardedSampler(len(ds), 2)
    first = [ds.locate(g)[1] for g in sampler]
    sampler.set_epoch(3)  # what Lightning does each epoch
    assert [ds.locate(g)[1] for g in sampler] == first == list(range(10))


@FAST
@given(
    weights=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6),
    size=st.integers(1, 400),
)
def test_blend_every_prefix_within_one_sample_of_its_weight(weights, size):
    index, within = blend_schedule(weights, size)
    w = np.asarray(weights) / np.sum(weights)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[index], axis=0)  # (size, D) per prefix
    prefix = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - w * prefix).max() < 1
    for d in range(len(w)):  # within-corpus draw numbers run 0, 1, 2, ...
        np.testing.assert_array_equal(within[index == d], np.arange((index == d).sum()))


def test_blend_simple_ratios():
    index, _ = blend_schedule([1, 1], 6)
    assert index.tolist() == [0, 1, 0, 1, 0, 1]
    index, _ = blend_schedule([3, 1], 400)
    assert np.bincount(index[:100]).tolist() == [75, 25]
    assert all(np.bincount(index[4 * k : 4 * k + 4], minlength=2).tolist() == [3, 1] for k in range(100))


def test_blended_corpora_are_shuffled_and_cycled_per_pass():
    small, large = PackedDataset(np.arange(5 * 2), 2), PackedDataset(np.arange(50 * 2), 2)
    ds = BlendedDataset([small, large], [1, 1], seed=7, epoch_size=40)  # small (5 samples) cycles 4x/epoch
    draws = {0: [], 1: []}
    for g in range(3 * len(ds)):  # three epochs
        d, i = ds.locate(g)
        draws[d].append(i)
    assert len(draws[0]) == len(draws[1]) == 60
    passes = [draws[0][k : k + 5] for k in range(0, 60, 5)]
    assert all(sorted(p) == list(range(5)) for p in passes)  # each pass = a permutation
    assert len({tuple(p) for p in passes}) > 1  # reshuffled between passes
    assert len(set(draws[1][:50])) == 50  # large corpus: no repeat within its first pass
    sample = ds[41]
    assert (
        sample.index == 41
        and sample.tokens.tolist() == ds.datasets[ds.locate(41)[0]][ds.locate(41)[1]].tolist()
    )


def test_bad_weights():
    ds = [PackedDataset(np.arange(10), 2)] * 2
    with pytest.raises(ValueError, match="one weight per"):
        BlendedDataset(ds, [1.0])
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset(ds, [1.0, 0.0])


@FAST
@given(
    epoch_size=st.integers(1, 120),
    batch=st.integers(1, 4),
    world=st.integers(1, 3),
    data=st.data(),
)
def test_resume_after_any_number_of_batches_continues_the_stream(epoch_size, batch, world, data):
    if epoch_size < batch * world:
        return
    rank = data.draw(st.integers(0, world - 1))
    sampler = ResumableSampler(epoch_size, batch, rank=rank, world_size=world)
    per_epoch = sampler.batches_per_epoch
    full = [i for _ in range(3) for i in sampler]  # three uninterrupted epochs, in batches of `batch`
    assert sampler.state_dict() == {"epoch": 3, "consumed_samples": 0}
    k = data.draw(st.integers(0, 3 * per_epoch - 1))  # batches read before the interruption
    state = {"epoch": k // per_epoch, "consumed_samples": (k % per_epoch) * batch * world}
    resumed = ResumableSampler(epoch_size, batch, rank=rank, world_size=world)
    resumed.load_state_dict(state)
    assert len(resumed) == per_epoch * batch  # the whole epoch, as Lightning expects
    rest = [i for _ in range(3 - state["epoch"]) for i in resumed]
    assert rest == full[k * batch :]


def test_resume_state_must_fit_the_global_batch():
    sampler = ResumableSampler(100, 4, world_size=2)
    with pytest.raises(ValueError, match="multiple of the global batch size 8"):
        sampler.load_state_dict({"epoch": 0, "consumed_samples": 12})
    sampler.load_state_dict({"epoch": 1, "consumed_samples": 96})  # a complete epoch -> the next one
    assert sampler.state_dict() == {"epoch": 2, "consumed_samples": 0}
    sampler.set_epoch(2)  # Lightning's call at the start of that epoch keeps the position
    assert sampler.state_dict() == {"epoch": 2, "consumed_samples": 0}


def test_memory_mapped_corpus_pickles_as_its_location(tmp_path):
    import pickle

    from shards import write_shard

    from pretrain.datamodules.indexed import IndexedDataset

    write_shard(tmp_path / "train", [np.arange(1000)], np.uint16)
    ds = PackedDataset(IndexedDataset(tmp_path / "train").tokens, 10)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the location, not the 2000 bytes of tokens
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again[7], np.arange(70, 80))
    plain = PackedDataset(np.arange(100), 10)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(plain))[3], np.arange(30, 40))


@FAST
@given(
    shards=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=6), min_size=1, max_size=3),
    length=st.integers(1, 25),
)
def test_sample_document_ids_are_the_documents_of_the_index(tmp_path_factory, shards, length):
    """Document ids of every sample, read from shards' Megatron indices (memory-mapped, pickled as locations):
    0 at the sample's start, +1 exactly where the stream's next document starts (a shard starts one)."""
    import pickle

    from shards import write_shard

    from pretrain.datamodules.dataset import DocumentStarts
    from pretrain.datamodules.indexed import IndexedDataset

    root = tmp_path_factory.mktemp("shards")
    stream_docs = []
    for k, lengths in enumerate(shards):
        write_shard(root / f"s{k}", [np.full(n, 7) for n in lengths], np.uint16)
        for n in lengths:
            stream_docs.append(np.full(n, len(stream_docs)))
    stream = np.concatenate(stream_docs)  # each token's document in the whole stream
    if len(stream) < length:
        return
    prefixes = [root / f"s{k}" for k in range(len(shards))]
    ds = PackedDataset(
        [IndexedDataset(p).tokens for p in prefixes], length, documents=[DocumentStarts(p) for p in prefixes]
    )
    again = pickle.loads(pickle.dumps(ds))
    for i in range(len(ds)):
        expected = stream[i * length : (i + 1) * length]
        for data in (ds, again):
            tokens, documents = data.sample(i)
            np.testing.assert_array_equal(documents, expected - expected[0])
            np.testing.assert_array_equal(tokens, data[i])
    assert PackedDataset(np.arange(length), length).sample(0)[1] is None
