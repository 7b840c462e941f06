"""Mixture schedules (``pretrain.datamodules.schedule``): the per-step apportionment, the stream as a pure function of
(seed, position), exact resume across a phase boundary (1 and 2 ranks), tokens per source, bad schedules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shards import write_shard

from pretrain import config
from pretrain.datamodules.dataset import PackedDataset
from pretrain.datamodules.pretrain import PretrainDataModule
from pretrain.datamodules.schedule import MixtureSchedule, ScheduledBlend, step_counts

L = 8  # raw tokens per sample (seq_len 7 + 1 with the causal objective below)
BASE = 10_000  # corpus d's token ids start at d * BASE: a sample's first token names its corpus


class Causal:
    def raw_length(self, input_length: int) -> int:
        return input_length + 1

    def __call__(self, tokens, generators):
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


@st.composite
def schedules(draw, max_sources: int = 4):
    d = draw(st.integers(1, max_sources))
    phases = draw(st.integers(1, 4))
    starts = [0, *sorted(draw(st.sets(st.integers(1, 40), min_size=phases - 1, max_size=phases - 1)))]
    rows = []
    for _ in starts:
        raw = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 2, 5]), min_size=d, max_size=d)), float)
        raw[draw(st.integers(0, d - 1))] += 1  # at least one source weighted
        rows.append(raw / raw.sum())
    return MixtureSchedule(starts, rows, draw(st.sampled_from(["constant", "linear"])))


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(1, 13), st.integers(1, 30))
def test_step_counts_follow_the_scheduled_integral(schedule, g, chunk):
    steps = 60
    n, _ = step_counts(schedule, g, 0, steps)
    w = schedule.weights_at(np.arange(steps))
    assert (n >= 0).all() and (n.sum(1) == g).all()
    assert (n[w == 0] == 0).all()  # a source weighted 0 at a step gets nothing at that step
    lag = np.cumsum(n, 0) - np.cumsum(g * w, 0)
    assert np.abs(lag).max() < schedule.num_sources  # every prefix of steps within D samples per source
    if schedule.num_sources <= 2:
        assert np.abs(lag).max() < 1 + 1e-9
    parts, state = [], None  # computed in chunks (as a resumed run does), the counts are the same
    for first in range(0, steps, chunk):
        part, state = step_counts(schedule, g, first, min(chunk, steps - first), state)
        parts.append(part)
    assert (np.concatenate(parts) == n).all()


def corpora(sizes: list[int]) -> list[PackedDataset]:
    return [PackedDataset(np.arange(d * BASE, d * BASE + s * L), L) for d, s in enumerate(sizes)]


@settings(max_examples=25, deadline=None)
@given(schedules(3), st.integers(1, 9), st.integers(0, 2**31), st.lists(st.integers(0, 3000), max_size=30))
def test_a_sample_is_a_pure_function_of_seed_and_position(schedule, g, seed, positions):
    sizes = [7, 30, 11][: schedule.num_sources]
    a = ScheduledBlend(corpora(sizes), schedule, g, seed=seed, epoch_size=g)
    b = ScheduledBlend(corpora(sizes), schedule, g, seed=seed, epoch_size=g)
    forward = [a.locate(i) for i in sorted(positions)]
    backward = [b.locate(i) for i in sorted(positions, reverse=True)][
        ::-1
    ]  # fresh, other order: a resumed run
    assert forward == backward
    # each source's draws walk through its samples: any window of N_d consecutive draws holds each sample once
    draws = [a.locate(i) for i in range(g * 25)]
    for d, size in enumerate(sizes):
        mine = [i for c, i in draws if c == d]
        for lo in range(0, len(mine) - size + 1, size):
            assert sorted(mine[lo : lo + size]) == list(range(size))


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    dirs = []
    for d, size in enumerate((40, 25)):
        directory = root / f"src{d}"
        directory.mkdir()
        write_shard(directory / "train", [np.arange(d * BASE, d * BASE + size * L)], np.int32)
        write_shard(directory / "val", [np.arange(d * BASE, d * BASE + 4 * L)], np.int32)
        dirs.append(directory)
    return dirs


SCHEDULE = MixtureSchedule([0, 3, 6], [[0.9, 0.1], [0.5, 0.5], [0.0, 1.0]], "linear")


def datamodules(dirs, world: int, schedule=SCHEDULE, **kw) -> list[PretrainDataModule]:
    out = []
    for rank in range(world):
        dm = PretrainDataModule(
            dirs,
            Causal(),
            seq_len=L - 1,
            micro_batch_size=2,
            rank=rank,
            world_size=world,
            schedule=schedule,
            names=["web", "books"],
            **kw,
        )
        dm.setup("fit")
        out.append(dm)
    return out


def read_steps(dms: list[PretrainDataModule], steps: int) -> list[list[torch.Tensor]]:
    """``steps`` global batches: per step, every rank's input ids (each rank's loader advances together)."""
    loaders = [
        iter(itertools.chain.from_iterable(itertools.repeat(dm.train_dataloader(), 100))) for dm in dms
    ]
    out = []
    for _ in range(steps):
        out.append([next(it)["input_ids"] for it in loaders])
        for dm in dms:
            dm.advance()
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stop", [2, 3, 7])  # before, at and after phase boundaries
def test_resume_anywhere_reads_the_uninterrupted_stream(two_sources, world, stop):
    steps = 9
    reference = read_steps(datamodules(two_sources, world), steps)
    interrupted = datamodules(two_sources, world)
    first = read_steps(interrupted, stop)
    fresh = datamodules(two_sources, world)
    for dm, old in zip(fresh, interrupted):
        dm.load_state_dict(old.state_dict())
    resumed = first + read_steps(fresh, steps - stop)
    for a, b in zip(reference, resumed, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    # the mix moves as scheduled: step 0 (weights 0.9, 0.1) is all source 0, the steps from 6 only source 1
    per_step = [torch.cat(step)[:, 0] // BASE for step in reference]
    assert (per_step[0] == 0).all() and all((s == 1).all() for s in per_step[6:])


def test_tokens_per_source_count_what_was_read(two_sources):
    (dm,) = datamodules(two_sources, 1)
    read = read_steps([dm], 8)
    sources = torch.cat([step[0] for step in read])[:, 0] // BASE
    assert dm.tokens_per_source() == {
        "web": int((sources == 0).sum()) * L,
        "books": int((sources == 1).sum()) * L,
    }


def test_a_resume_with_another_schedule_keeps_the_steps_before_it(two_sources):
    """``resume_allow=[data_schedule]``: the checkpoint's schedule for the steps before it (also when the new one
    moved a phase that lies before it), the new one after; no sample read twice or skipped."""
    stop, steps = 4, 9
    (before,) = datamodules(two_sources, 1)
    first = read_steps([before], stop)
    edited = MixtureSchedule([0, 2], [[0.9, 0.1], [0.2, 0.8]], "constant")  # the old one moved to step 2
    (resumed,) = datamodules(two_sources, 1, edited)
    resumed.load_state_dict(before.state_dict())
    rest = read_steps([resumed], steps - stop)
    g = 2  # samples per step
    assert [resumed.train_set.locate(i) for i in range(stop * g)] == [
        before.train_set.locate(i) for i in range(stop * g)
    ]
    first_token = torch.cat([step[0] for step in first + rest])[:, 0]
    source, sample = first_token // BASE, first_token % BASE // L
    for d in (0, 1):  # each source's draws: the first n of its (seeded) order, once each
        mine = sample[source == d].tolist()
        assert mine == resumed.train_set._permutation(d, 0)[: len(mine)].tolist()
    assert resumed.tokens_per_source() == {
        "web": int((source == 0).sum()) * L,
        "books": int((source == 1).sum()) * L,
    }
    later = source[stop * g :]
    assert abs(int((later == 1).sum()) - 0.8 * len(later)) <= 1  # the new weights from the resumed step on
    assert resumed.state_dict()["schedules"] == [
        {"first_step": 0, **SCHEDULE.spec()},
        {"first_step": stop, **edited.spec()},
    ]


RECIPE = "recipes/gpt-tiny.yaml"
SOURCES = "data.sources=[{name: web, prepared: a}, {name: books, prepared: b}]"


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ("[{start: 0, weights: {web: 0.6, books: 0.3}}]", r"phases\[0\].weights sum to 0.9, not 1"),
        (
            "[{start: 0, weights: {web: 1}}, {start: 9, weights: {news: 1}}]",
            r"unknown source\(s\) \['news'\]",
        ),
        (
            "[{start: 0, weights: {web: 1}}, {start: 0, weights: {books: 1}}]",
            r"phases\[1\].start=0 is not after",
        ),
        (
            "[{start: 0, weights: {web: 1}}, {start: 20, weights: {books: 1}}, {start: 10, weights: {web: 1}}]",
            "increasing step order",
        ),
        (
            "[{start: 0, weights: {web: 1}}, {start: 300, weights: {books: 1}}]",
            r"past the run's end \(trainer.max_steps=300\)",
        ),
        ("[{start: 5, weights: {web: 1}}]", "first phase must start at step 0"),
        ("[{start: 0, weights: {web: -0.5, books: 1.5}}]", "must be >= 0"),
    ],
)
def test_bad_schedules_are_one_named_error(phases, message):
    with pytest.raises(ValueError, match=message):
        config.load(RECIPE, [SOURCES, f"data.schedule.phases={phases}", "trainer.max_steps=300"])


def compared(*overrides: str, allow: tuple[str, ...] = ()) -> list[str]:
    """``FIT_RESUME`` between a two-source scheduled run and the same run with ``overrides``."""
    from pretrain.training.setup import FIT_RESUME, compare_for_resume

    phases = "[{start: 0, weights: {web: 1}}, {start: 5, weights: {web: 0.5, books: 0.5}}]"
    base = [SOURCES, f"data.schedule.phases={phases}", "trainer.max_steps=10"]
    saved, current = ({"config": config.load(RECIPE, base + list(o))[1]} for o in ((), overrides))
    return compare_for_resume(FIT_RESUME, saved, current, allow, "last.ckpt")


def test_an_edited_mixture_schedule_is_refused_or_applied_from_the_resumed_step():
    moved = "data.schedule.phases.1.start=3"
    with pytest.raises(ValueError, match=r"data.schedule.phases\[1\].start: checkpoint 5 vs config 3") as err:
        compared(moved)
    assert "resume_allow=[data_schedule]" in str(err.value) and "none is read twice or skipped" in str(
        err.value
    )
    with pytest.warns(UserWarning, match="the new schedule sets the mixture from the checkpoint's step on"):
        assert compared(moved, allow=("data_schedule",)) == ["data_schedule"]
    # the stream counts its draws per optimizer step: another step size is refused, allowed or not
    with pytest.raises(
        ValueError, match=r"samples per step .*: checkpoint \d+ vs config \d+; .*cannot change"
    ):
        compared("data.micro_batch_size=3", allow=("data_schedule",))
    with pytest.raises(ValueError, match="data.schedule has phases: checkpoint True vs config False"):
        compared("data.schedule.phases=[]", allow=("data_schedule",))


def test_a_refusal_suggests_no_resume_allow_it_would_not_pass(recwarn):
    """Dropping a run's schedule differs in data.schedule (allowable) and in whether it has phases (never): the
    line suggested resume_allow=[data_schedule], and that resume then warned "resuming ... although" before it
    was refused all the same. Now the line says nothing resume_allow lists passes it, and a refused resume
    warns of nothing."""
    with pytest.raises(ValueError, match="cannot change within a run, whatever resume_allow lists") as err:
        compared("data.schedule.phases=[]")
    assert "data.schedule: checkpoint" in str(err.value) and "pass resume_allow" not in str(err.value)
    with pytest.raises(ValueError, match="data.schedule has phases: checkpoint True vs config False"):
        compared("data.schedule.phases=[]", allow=("data_schedule",))
    assert not [w for w in recwarn if "resuming" in str(w.message)]
