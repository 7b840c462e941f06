"""Mixture schedules: per-source weights that change with the optimizer step, and the sample stream they give.

A schedule is phases ``(start_p, w_p)`` with ``start_0 = 0 < start_1 < ...``; the weights at step ``s`` are
``w_p`` for ``start_p <= s < start_{p+1}`` (``constant``), or interpolated linearly from ``w_p`` at ``start_p``
to ``w_{p+1}`` at ``start_{p+1}`` (``linear``); the last phase holds to the end.

Step ``s`` holds ``G`` samples (micro batch x accumulation x ranks), stream positions ``[s*G, (s+1)*G)``.
``step_counts`` gives source d ``n_d(s)`` of them: the cumulative count ``C_d(s) = sum_{s'<s} n_d(s')`` tracks
the scheduled integral ``T_d(s) = G * sum_{s'<s} w_d(s')`` within a sample or two (largest remainder on the
carried error; a source of weight 0 at step s gets nothing at s). The positions of step s are a permutation,
seeded by ``(seed, s)``, of those counts, and source d's k-th draw overall is sample ``perm(d, k // N_d)[k % N_d]``
as in ``BlendedDataset``. So sample ``g`` is a pure function of ``(seed, g)``: a run resumed at any step, across
a phase boundary too, reads what an uninterrupted one reads.

A run resumed with another schedule (``resume_allow=[data_schedule]``) follows ``SwitchedSchedule``: the
checkpoint's schedule for the steps before the resume, the new one from there on. Its carry continues, so the
samples of the earlier steps are those the earlier schedule drew and each source's draws go on where they stood
(none read twice or skipped).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from pretrain.datamodules.dataset import BlendedDataset, PackedDataset
from pretrain.errors import InputError

INTERPOLATIONS = ("constant", "linear")
_CHUNK = 4096  # steps of the cumulative table computed at a time


class MixtureSchedule:
    """``starts (P,)`` int steps and ``weights (P, D)`` (rows sum to 1), ``interpolation`` constant or linear."""

    def __init__(
        self, starts: Sequence[int], weights: Sequence[Sequence[float]], interpolation: str = "constant"
    ):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.weights = np.asarray(weights, dtype=np.float64)
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation={interpolation!r}; choose one of {INTERPOLATIONS}")
        if self.weights.ndim != 2 or len(self.starts) != len(self.weights) or len(self.starts) == 0:
            raise ValueError("a schedule needs one row of weights per phase, and at least one phase")
        if self.starts[0] != 0 or np.any(np.diff(self.starts) <= 0):
            raise ValueError(
                f"phase starts must begin at 0 and increase strictly, got {self.starts.tolist()}"
            )
        if np.any(self.weights < 0) or not np.allclose(self.weights.sum(1), 1, atol=1e-6):
            raise ValueError(f"each phase's weights must be >= 0 and sum to 1, got {self.weights.tolist()}")
        self.interpolation = interpolation

    @property
    def num_sources(self) -> int:
        return self.weights.shape[1]

    def weights_at(self, steps: np.ndarray) -> np.ndarray:
        """``(S, D)`` weights at optimizer ``steps (S,)``."""
        steps = np.asarray(steps, dtype=np.int64)
        phase = np.searchsorted(self.starts, steps, side="right") - 1
        w = self.weights[phase]
        if self.interpolation == "linear" and len(self.starts) > 1:
            inside = phase < len(self.starts) - 1
            nxt = np.minimum(phase + 1, len(self.starts) - 1)
            span = (self.starts[nxt] - self.starts[phase]).clip(min=1)
            t = np.where(inside, (steps - self.starts[phase]) / span, 0.0)[:, None]
            w = (1 - t) * w + t * self.weights[nxt]
        return w

    def spec(self) -> dict:
        """The schedule as plain data (``MixtureSchedule(**spec)`` rebuilds it)."""
        return {
            "starts": self.starts.tolist(),
            "weights": self.weights.tolist(),
            "interpolation": self.interpolation,
        }


class SwitchedSchedule:
    """``segments``: ``(first step, MixtureSchedule)`` in step order from 0 -- the weights at step s are those of
    the last segment starting at or before s, evaluated at s."""

    def __init__(self, segments: Sequence[tuple[int, MixtureSchedule]]):
        firsts = [first for first, _ in segments]
        if not segments or firsts[0] != 0 or any(b <= a for a, b in itertools.pairwise(firsts)):
            raise ValueError(f"segments must start at step 0 and increase strictly, got {firsts}")
        if len({s.num_sources for _, s in segments}) != 1:
            raise ValueError("every segment must weigh the same sources")
        self.firsts = np.asarray(firsts, dtype=np.int64)
        self.schedules = [s for _, s in segments]

    @property
    def num_sources(self) -> int:
        return self.schedules[0].num_sources

    def weights_at(self, steps: np.ndarray) -> np.ndarray:
        steps = np.asarray(steps, dtype=np.int64)
        which = np.searchsorted(self.firsts, steps, side="right") - 1
        out = np.empty((len(steps), self.num_sources))
        for k, schedule in enumerate(self.schedules):
            mask = which == k
            if mask.any():
                out[mask] = schedule.weights_at(steps[mask])
        return out


def step_counts(
    schedule: MixtureSchedule | SwitchedSchedule,
    samples_per_step: int,
    first: int,
    count: int,
    state: tuple | None = None,
):
    """Per-step source counts ``n (count, D)`` of steps ``first .. first+count-1``, and the carry ``(C, T)`` after
    them; ``state`` is the carry at step ``first`` (zeros at step 0). See the module docstring."""
    g = samples_per_step
    d = schedule.num_sources
    cum, target = (np.zeros(d, np.int64), np.zeros(d)) if state is None else state
    w = schedule.weights_at(np.arange(first, first + count))
    out = np.empty((count, d), dtype=np.int64)
    for i in range(count):
        target = target + g * w[i]
        desired = target - cum
        n = np.maximum(np.floor(desired).astype(np.int64), 0)
        n[w[i] == 0] = 0
        short = g - int(n.sum())
        if short > 0:  # largest remainders first, among the sources weighted at this step
            order = np.lexsort((np.arange(d), -(desired - n)))
            order = order[w[i][order] > 0]
            base, extra = divmod(short, len(order))
            n[order] += base
            n[order[:extra]] += 1
        elif short < 0:  # smallest remainders give one back
            order = np.lexsort((np.arange(d), desired - n))
            order = order[n[order] > 0]
            n[order[:-short]] -= 1
        out[i] = n
        cum = cum + n
    return out, (cum, target)


class ScheduledBlend(BlendedDataset):
    """The training stream of ``datasets`` mixed by ``schedule`` (module docstring); ``ds[g]`` is
    ``Sample(g, tokens, document_ids)``. ``epoch_size`` (default: all samples) is rounded down to whole steps."""

    def __init__(
        self,
        datasets: Sequence[PackedDataset],
        schedule: MixtureSchedule | SwitchedSchedule,
        samples_per_step: int,
        *,
        seed: int = 0,
        epoch_size: int | None = None,
    ):
        if len(datasets) != schedule.num_sources:
            raise ValueError(
                f"the schedule has weights for {schedule.num_sources} sources, got {len(datasets)}"
            )
        if seed < 0 or samples_per_step < 1:
            raise ValueError(f"need seed >= 0 and samples_per_step >= 1, got {seed} and {samples_per_step}")
        self.datasets, self.schedule, self.samples_per_step = list(datasets), schedule, samples_per_step
        self.seed, self.shuffle = seed, True
        size = sum(map(len, self.datasets)) if epoch_size is None else epoch_size
        self.epoch_size = size // samples_per_step * samples_per_step
        if self.epoch_size < 1:
            raise InputError(
                f"{size} samples per epoch are fewer than one optimizer step of {samples_per_step} samples; add "
                "data, lower seq_len, micro_batch_size or accumulate_grad_batches"
            )
        self._cum = np.zeros((1, len(self.datasets)), dtype=np.int64)  # C(s) for s = 0 .. len-1
        self._carry: tuple | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._step: tuple[int, np.ndarray, np.ndarray] | None = None  # (step, source of each slot, its rank)

    def cumulative(self, step: int) -> np.ndarray:
        """``(D,)`` samples of each source in the steps before ``step``."""
        while len(self._cum) <= step:
            n, self._carry = step_counts(
                self.schedule, self.samples_per_step, len(self._cum) - 1, _CHUNK, self._carry
            )
            self._cum = np.concatenate([self._cum, self._cum[-1] + np.cumsum(n, axis=0)])
        return self._cum[step]

    def _slots(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each of the step's positions, and how many earlier positions of the step have it."""
        if self._step is None or self._step[0] != step:
            counts = self.cumulative(step + 1) - self.cumulative(step)
            source = np.repeat(np.arange(len(counts)), counts)
            source = np.random.default_rng([self.seed, 0x5C4ED, step]).permutation(source)
            rank = np.empty_like(source)
            for d in range(len(counts)):
                rank[source == d] = np.arange(int(counts[d]))
            self._step = (step, source, rank)
        return self._step[1], self._step[2]

    def locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            raise IndexError(f"stream index must be >= 0, got {index}")
        step, slot = divmod(index, self.samples_per_step)
        source, rank = self._slots(step)
        d = int(source[slot])
        draw = int(self.cumulative(step)[d]) + int(rank[slot])
        cycle, offset = divmod(draw, len(self.datasets[d]))
        return d, int(self._permutation(d, cycle)[offset])

    def source_counts(self, end: int) -> np.ndarray:
        """``(D,)`` samples of each source among stream positions ``[0, end)``."""
        step, slot = divmod(end, self.samples_per_step)
        source, _ = self._slots(step)
        return self.cumulative(step) + np.bincount(source[:slot], minlength=len(self.datasets))
