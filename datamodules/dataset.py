"""Packed pretraining samples: fixed-length cuts of token streams, blended, shuffled, sharded, resumable.

Three pieces, each small:

* ``PackedDataset``: sample ``i`` of a corpus is ``tokens[i*L:(i+1)*L]`` of its concatenated token stream
  (documents end with EOS; samples cross document boundaries); the tail ``< L`` is dropped. Given where the
  documents start (``DocumentStarts``, read from the prepared index), a sample also carries its tokens'
  ``document_ids`` (L,): 0 for the document it starts in, +1 at every document start inside it (a pure
  function of ``i``, so a resumed run reads the same ids).
* ``BlendedDataset``: the training *stream*. One epoch is ``epoch_size`` positions; position ``j`` of epoch
  ``e`` has stream index ``g = e * epoch_size + j``. The corpus of each position follows a fixed schedule
  with exact proportions (``blend_schedule``); within a corpus, draws walk through a fresh permutation of
  its samples per pass (seeded by ``(seed, corpus, pass)``), so with one corpus and the default epoch size,
  epoch ``e`` is exactly one seeded permutation of all samples (Megatron-LM's BlendedDataset + GPTDataset
  shuffle, without the on-disk index cache).
* ``ShardedSampler`` / ``ResumableSampler``: which stream indices this data-parallel rank reads. Global batch
  ``t`` is positions ``[t*W*B, (t+1)*W*B)`` and rank ``r`` takes ``[t*W*B + r*B, t*W*B + (r+1)*B)``, so every
  rank gets distinct samples and the same number of batches (the last ``epoch_size mod W*B`` positions of an
  epoch are skipped, a different set each epoch). ``ResumableSampler`` starts at ``(epoch,
  consumed_samples)`` and yields indices in the main process, so its position never depends on workers.

Both samplers subclass ``DistributedSampler`` only so that Lightning sees the data already sharded and does
not wrap them in another distributed sampler (``Trainer(use_distributed_sampler=True)`` is then harmless).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from pretrain.errors import InputError


class DocumentStarts:
    """Token offsets at which the documents of one token shard start, read from its Megatron index without a
    copy: the index's byte ``pointers`` (N,) (memory-mapped) over the token size; for a Megatron corpus whose
    sequences are sentences, the pointers of its ``document_indices``. ``from_lengths`` builds one in memory."""

    def __init__(self, prefix: str | os.PathLike | None = None, lengths: Sequence[int] | None = None):
        self.prefix = prefix
        if prefix is not None:
            from pretrain.datamodules.indexed import IndexedDataset

            index = IndexedDataset(prefix)
            pointers, self.itemsize = index.pointers, index.dtype.itemsize
            if len(index.document_indices) != len(pointers) + 1:  # sequences are not documents
                pointers = pointers[index.document_indices[:-1]]
            self.pointers = pointers
        else:
            self.itemsize = 1
            self.pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))[:-1]])

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> DocumentStarts:
        """Documents of these lengths, back to back from offset 0."""
        return cls(lengths=lengths)

    def within(self, lo: int, hi: int) -> np.ndarray:
        """Document starts ``s`` with ``lo < s < hi``, as offsets from ``lo`` (int64, ascending)."""
        a = int(np.searchsorted(self.pointers, (lo + 1) * self.itemsize, side="left"))
        b = int(np.searchsorted(self.pointers, hi * self.itemsize, side="left"))
        return np.asarray(self.pointers[a:b], dtype=np.int64) // self.itemsize - lo

    def __getstate__(self) -> dict:  # a shard's index is pickled as its location (workers re-map it)
        return {"prefix": self.prefix} if self.prefix is not None else self.__dict__

    def __setstate__(self, state: dict) -> None:
        if "pointers" in state:
            self.__dict__.update(state)
        else:
            self.__init__(state["prefix"])  # type: ignore[misc]


class PackedDataset(Dataset):
    """Fixed-length samples of one token stream ``tokens (N,)``: sample i = ``tokens[i*L:(i+1)*L]``. ``tokens``
    may be a list of arrays (the shards of a corpus prepared in tasks), read as their concatenation;
    ``documents``: where each shard's documents start (one ``DocumentStarts`` per shard), for ``sample``'s
    document ids (a shard starts a document)."""

    def __init__(
        self,
        tokens: np.ndarray | Sequence[np.ndarray],
        sample_length: int,
        name: str = "corpus",
        documents: Sequence[DocumentStarts] | None = None,
    ):
        if sample_length < 1:
            raise ValueError(f"sample_length must be >= 1, got {sample_length}")
        if documents is not None and not isinstance(tokens, np.ndarray):
            documents = [d for t, d in zip(tokens, documents, strict=True) if len(t)] or list(documents)[:1]
        shards = (
            [tokens] if isinstance(tokens, np.ndarray) else [t for t in tokens if len(t)] or list(tokens)[:1]
        )
        self.documents = None if documents is None else list(documents)
        self.shards = [np.asarray(t) for t in shards]  # plain views (no copy): indexing a np.memmap is slower
        self.sample_length, self.name = sample_length, name
        # a memory-mapped file is pickled as its location (spawned workers re-map it instead of copying it)
        self._mappings = [
            (t.filename, t.dtype, t.offset, t.shape) if isinstance(t, np.memmap) and t.filename else None
            for t in shards
        ]
        self.offsets = np.concatenate([[0], np.cumsum([len(t) for t in self.shards])]).astype(np.int64)
        total = int(self.offsets[-1])
        self.num_samples = total // sample_length
        if self.num_samples == 0:
            raise InputError(
                f"corpus {name!r} has {total} tokens, fewer than one sample of {sample_length} tokens "
                f"(the objective's raw length for the configured seq_len); add text to it or lower seq_len"
            )

    @property
    def tokens(self) -> np.ndarray:
        """The whole stream (a view for one shard, a copy for several)."""
        return self.shards[0] if len(self.shards) == 1 else np.concatenate(self.shards)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict:
        shards = [None if m else t for t, m in zip(self.shards, self._mappings)]
        return {**self.__dict__, "shards": shards}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.shards = [
            np.asarray(np.memmap(m[0], dtype=m[1], mode="r", offset=m[2], shape=m[3])) if m else t
            for t, m in zip(self.shards, self._mappings)
        ]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Sample ``i`` and its ``document_ids`` (both int64 ``(L,)``; None without ``documents``)."""
        tokens = self[i]
        if self.documents is None:
            return tokens, None
        starts = np.zeros(self.sample_length, dtype=np.int64)
        lo, hi = i * self.sample_length, (i + 1) * self.sample_length
        k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while k < len(self.shards) and self.offsets[k] < hi:
            base = int(self.offsets[k])
            if base > lo:
                starts[base - lo] = 1  # a shard starts a document
            inside = self.documents[k].within(max(lo, base) - base, min(hi, int(self.offsets[k + 1])) - base)
            starts[inside + max(lo, base) - lo] = 1
            k += 1
        return tokens, np.cumsum(starts)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` as int64 ``(L,)``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.name!r} with {self.num_samples} samples")
        start = i * self.sample_length
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        lo = start - int(self.offsets[k])
        piece = self.shards[k][lo : lo + self.sample_length]
        if len(piece) == self.sample_length:
            return np.asarray(piece, dtype=np.int64)
        parts, need = [piece], self.sample_length - len(piece)  # the sample crosses into the next shard(s)
        while need:
            k += 1
            parts.append(self.shards[k][:need])
            need -= len(parts[-1])
        return np.concatenate(parts).astype(np.int64)


def normalize_weights(weights: Sequence[float] | np.ndarray | None, count: int) -> np.ndarray:
    """``(count,)`` float64 summing to 1; ``None`` means equal weights. ValueError on bad input."""
    if weights is None:
        return np.full(count, 1.0 / count)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (count,):
        raise InputError(f"got {w.size} weights for {count} corpora; give one weight per prepared dir")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise InputError(f"weights must be positive finite numbers, got {list(weights)}")
    return w / w.sum()


def blend_schedule(weights: Sequence[float] | np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Corpus of each of ``size`` positions, with exact proportions in every prefix.

    Returns ``dataset_index (size,)`` int64 and ``dataset_sample_index (size,)`` int64 (how many earlier
    positions chose the same corpus). Earliest-deadline-first apportionment (Tijdeman 1980, the "chairman
    assignment problem"): with ``D`` corpora and ``delta = 1/(2D-2)``, corpus d is eligible at step t
    (1-based) once ``w_d*t - c_d >= delta`` and its deadline is ``(c_d + 1 - delta)/w_d``; the eligible
    corpus with the earliest deadline is picked. Then ``|c_d(P) - w_d*P| <= 1 - delta < 1`` for every
    prefix length P: every prefix holds each corpus within one sample of its weight. (Megatron's greedy
    "largest lag" rule can drift past one sample with several corpora.)
    """
    w = normalize_weights(weights, len(weights))
    d_count = len(w)
    dataset_index = np.zeros(size, dtype=np.int64)
    if d_count > 1:
        delta = 1.0 / (2 * d_count - 2)
        eps = 1e-9  # float slack on the eligibility test
        counts = [0] * d_count
        pending = [((delta - eps) / w[d], d) for d in range(d_count)]  # (release step, corpus)
        heapq.heapify(pending)
        ready: list[tuple[float, int]] = []  # (deadline, corpus)
        for t in range(1, size + 1):
            while pending and pending[0][0] <= t:
                d = heapq.heappop(pending)[1]
                heapq.heappush(ready, ((counts[d] + 1 - delta) / w[d], d))
            d = heapq.heappop(ready)[1]
            dataset_index[t - 1] = d
            counts[d] += 1
            heapq.heappush(pending, ((counts[d] + delta - eps) / w[d], d))
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for d in range(d_count):
        chosen = dataset_index == d
        dataset_sample_index[chosen] = np.arange(int(chosen.sum()))
    return dataset_index, dataset_sample_index


class Sample(NamedTuple):
    """One packed sample and its stream index ``g = epoch * epoch_size + position``."""

    index: int  # type: ignore[assignment]  # the stream index g, a field named as tuple's method (not used here)
    tokens: np.ndarray  # (L,) int64
    document_ids: np.ndarray | None = None  # (L,) int64, 0 for the first document (``PackedDataset.sample``)


class BlendedDataset(Dataset):
    """The sample stream over ``datasets`` (``PackedDataset``s), mixed by ``weights``.

    ``ds[g]`` for any stream index ``g >= 0`` is ``Sample(g, tokens, document_ids)``; ``len(ds)`` is ``epoch_size``
    (default: the total number of samples). Per epoch corpus d gets ``counts[d]`` positions; its k-th draw
    overall (counting across epochs) is sample ``perm(d, k // n_d)[k % n_d]``, a fresh seeded permutation
    per pass over the corpus (identity order when ``shuffle=False``, as for validation).
    """

    def __init__(
        self,
        datasets: Sequence[PackedDataset],
        weights: Sequence[float] | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epoch_size: int | None = None,
    ):
        if not datasets:
            raise ValueError("BlendedDataset needs at least one dataset")
        if seed < 0:
            raise InputError(f"seed must be >= 0, got {seed}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, len(self.datasets))
        self.seed, self.shuffle = seed, shuffle
        self.epoch_size = sum(map(len, self.datasets)) if epoch_size is None else epoch_size
        if self.epoch_size < 1:
            raise ValueError(f"epoch_size must be >= 1, got {self.epoch_size}")
        self.dataset_index, self.dataset_sample_index = blend_schedule(self.weights, self.epoch_size)
        self.counts = np.bincount(self.dataset_index, minlength=len(self.datasets))  # (D,) per epoch
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # (corpus, pass) -> permutation, a small cache

    def __len__(self) -> int:
        return self.epoch_size

    def _permutation(self, d: int, cycle: int) -> np.ndarray:
        key = (d, cycle)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.datasets):  # at most two passes per corpus are live
                del self._perms[next(iter(self._perms))]
            rng = np.random.default_rng([self.seed, d, cycle])
            self._perms[key] = rng.permutation(len(self.datasets[d]))
        return self._perms[key]

    def locate(self, index: int) -> tuple[int, int]:
        """``(corpus, sample)`` at stream index ``index``."""
        if index < 0:
            raise IndexError(f"stream index must be >= 0, got {index}")
        epoch, position = divmod(index, self.epoch_size)
        d = int(self.dataset_index[position])
        draw = epoch * int(self.counts[d]) + int(self.dataset_sample_index[position])
        cycle, offset = divmod(draw, len(self.datasets[d]))
        return d, int(self._permutation(d, cycle)[offset]) if self.shuffle else offset

    def source_counts(self, end: int) -> np.ndarray:
        """``(D,)`` samples of each corpus among stream positions ``[0, end)``."""
        epoch, position = divmod(end, self.epoch_size)
        return epoch * self.counts + np.bincount(self.dataset_index[:position], minlength=len(self.datasets))

    def __getitem__(self, index: int) -> Sample:
        d, i = self.locate(index)
        return Sample(index, *self.datasets[d].sample(i))


def global_batch_size(micro_batch_size: int, world_size: int) -> int:
    """Samples of one data-parallel batch over all ranks (an optimizer step reads k of them)."""
    return micro_batch_size * world_size


class ShardedSampler(DistributedSampler):
    """This rank's stream indices of epoch 0 in fixed order (validation); see the module docstring."""

    def __init__(self, epoch_size: int, micro_batch_size: int, *, rank: int = 0, world_size: int = 1):
        assert 0 <= rank < world_size, (rank, world_size)
        self.epoch_size, self.micro_batch_size = epoch_size, micro_batch_size
        self.rank, self.num_replicas = rank, world_size
        self.global_batch_size = global_batch_size(micro_batch_size, world_size)
        self.batches_per_epoch = epoch_size // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise InputError(
                f"{epoch_size} samples per epoch are fewer than one global batch of {self.global_batch_size} "
                f"(micro_batch_size {micro_batch_size} x world size {world_size}); add data, lower seq_len "
                f"or micro_batch_size"
            )

    def __len__(self) -> int:
        """Samples this rank reads in a whole epoch (batches_per_epoch * micro_batch_size)."""
        return self.batches_per_epoch * self.micro_batch_size

    def _indices(self, epoch: int, start_batch: int) -> Iterator[int]:
        for t in range(start_batch, self.batches_per_epoch):
            first = epoch * self.epoch_size + t * self.global_batch_size + self.rank * self.micro_batch_size
            yield from range(first, first + self.micro_batch_size)

    def __iter__(self) -> Iterator[int]:
        return self._indices(0, 0)

    def set_epoch(self, epoch: int) -> None:
        """No-op: the validation order never changes (Lightning calls this on every sampler)."""


class ResumableSampler(ShardedSampler):
    """Training indices: one epoch per ``iter()``, from ``(epoch, consumed_samples)``; then the next epoch.

    ``consumed_samples`` counts global samples (all ranks) already used in ``epoch``; it must be a multiple of
    the global batch size. ``len()`` stays the whole epoch's count even when resuming mid-epoch, because
    Lightning restores its own batch counter and stops the epoch when that counter reaches ``len``.
    """

    epoch: int
    consumed_samples: int  # set by load_state_dict

    def __init__(
        self,
        epoch_size: int,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        consumed_samples: int = 0,
    ):
        super().__init__(epoch_size, micro_batch_size, rank=rank, world_size=world_size)
        self.load_state_dict({"epoch": epoch, "consumed_samples": consumed_samples})

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self.consumed_samples // self.global_batch_size
        yield from self._indices(epoch, start)
        self.epoch, self.consumed_samples = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """No-op: the position is ``load_state_dict``'s, not the epoch number of the loop calling this
        (Lightning's runs one ahead of the data after a finished run is extended)."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed_samples"])
        per_epoch = self.batches_per_epoch * self.global_batch_size
        if epoch < 0 or not 0 <= consumed <= per_epoch or consumed % self.global_batch_size:
            raise InputError(
                f"cannot resume at epoch {epoch} after {consumed} samples: need epoch >= 0 and a multiple of "
                f"the global batch size {self.global_batch_size} in [0, {per_epoch}]; resume with the "
                f"micro-batch size and world size of the run that saved the state (or ones whose product "
                f"divides it)"
            )
        self.epoch, self.consumed_samples = (epoch + 1, 0) if consumed == per_epoch else (epoch, consumed)
