"""``PretrainDataModule``: prepared token shards -> packed, blended, sharded, resumable batches.

Per sample the datamodule reads ``objective.raw_length(seq_len)`` raw tokens (``seq_len + 1`` for causal LM,
the longer raw span for T5 span corruption) from the prepared ``train`` split of each directory
(``pretrain.datamodules.dataset``), and the collate function applies the objective. The objective's randomness for a
sample comes from its own generator seeded by a hash of ``(seed, split, epoch, position)``, so batches do not
depend on ``num_workers``. Validation reads the directories' ``val`` splits in fixed order (no shuffle),
blended with the same weights.

Resume (exact, mid-epoch, any ``num_workers``): the state is ``(seed, epoch, consumed_samples)`` where
``consumed_samples`` counts global samples of ``epoch`` that the *training loop received*. Samplers and
workers run ahead (prefetching), so the count is advanced in ``on_after_batch_transfer`` -- which Lightning
calls for every training batch right before ``training_step`` -- not by the sampler. Lightning 2.x stores
``LightningDataModule.state_dict()`` in every checkpoint (``CheckpointConnector.dump_checkpoint``) and calls
``load_state_dict`` on ``fit(ckpt_path=...)`` before it builds the dataloaders. Every ``iter()`` of the
training loader starts at that received position, and the data's epoch never follows the loop's epoch
number: Lightning counts an epoch cut short by ``max_steps`` or a stop request as finished, so a finished run
resumed with a larger ``max_steps`` counts one epoch more than its data has used (the data's count is the
one that holds). Loops driven by hand call ``advance()`` once per batch they consume.
Notes: this datamodule's ``on_after_batch_transfer`` takes precedence over a LightningModule's (Lightning's
rule); Lightning's warning "resuming from a checkpoint that ended before the epoch ended and your dataloader
is not resumable" does not apply here (it looks for a stateful DataLoader, not for the datamodule's state).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader

from pretrain.datamodules.dataset import (
    BlendedDataset,
    PackedDataset,
    ResumableSampler,
    Sample,
    ShardedSampler,
    global_batch_size,
)
from pretrain.datamodules.hashing import splitmix64
from pretrain.datamodules.schedule import MixtureSchedule, ScheduledBlend, SwitchedSchedule
from pretrain.errors import InputError
from pretrain.parallel.context import SequenceShard
from pretrain.parallel.mesh import context_parallel_position, data_parallel_position

TRAIN, VAL = "train", "val"
_STREAM_ID = {TRAIN: 0, VAL: 1}


class Batches(Protocol):
    """A sized iterable of batches: the training ``DataLoader``, or one in optimizer-step groups
    (``pretrain.training.step.StepGroups``)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class Objective(Protocol):
    """What the datamodule needs of an objective (see ``objectives``)."""

    def raw_length(self, input_length: int) -> int: ...

    def __call__(
        self, tokens: Tensor, generator: Sequence[torch.Generator], document_ids: Tensor | None = None
    ) -> dict[str, Tensor]: ...


def sample_seeds(seed: int, stream: int, epochs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``(B,)`` uint64 generator seeds, one per sample: a hash chain over (seed, stream, epoch, position)."""
    h = splitmix64(np.full(len(epochs), seed, dtype=np.uint64))
    for value in (np.uint64(stream), np.asarray(epochs, np.uint64), np.asarray(positions, np.uint64)):
        h = splitmix64(h ^ value)
    return h


def check_document_lengths(data_dirs: Sequence[Path]) -> None:
    """``InputError`` unless every prepared directory records that its index holds the document lengths."""
    for path in data_dirs:
        meta_path = path / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if meta.get("document_lengths") != "index":
            raise InputError(
                f"data.document_mask needs each corpus's document lengths, but {path} records none (prepared by an "
                "older version or another tool); rerun `pretrain prepare`, or set data.document_mask=false"
            )


class ObjectiveCollate:
    """``list[Sample]`` -> the objective's batch dict; row b uses its own generator (see ``sample_seeds``). Under
    context parallelism ``shard`` then cuts the whole batch to this rank's positions of every sequence (the
    objective sees whole sequences: its masking and targets are the one-process ones)."""

    def __init__(
        self, objective: Objective, seed: int, epoch_size: int, split: str, shard: SequenceShard | None = None
    ):
        self.objective, self.seed, self.epoch_size = objective, seed, epoch_size
        self.stream = _STREAM_ID[split]
        self.shard = shard

    def __call__(self, samples: list[Sample]) -> dict[str, Tensor]:
        tokens = torch.from_numpy(np.stack([s.tokens for s in samples]))  # (B, L) int64
        epochs, positions = np.divmod([s.index for s in samples], self.epoch_size)
        seeds = sample_seeds(self.seed, self.stream, epochs, positions)
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        if samples[0].document_ids is None:
            batch = self.objective(tokens, generators)
        else:
            documents = torch.from_numpy(
                np.stack([s.document_ids for s in samples if s.document_ids is not None])  # every one's
            )  # (B, L) int64
            batch = self.objective(tokens, generators, documents)
        return batch if self.shard is None else self.shard(batch)


class ReceivedPositionLoader(DataLoader):
    """A training ``DataLoader`` whose every ``iter()`` starts its ``ResumableSampler`` at
    ``(position.epoch, position.consumed_samples)``: what the training loop has received, not what the sampler
    or the workers read ahead, nor the epoch number of the loop driving it (see the module docstring)."""

    def __init__(self, *args: Any, position: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.position = position

    def __iter__(self) -> Any:
        assert isinstance(self.sampler, ResumableSampler)
        self.sampler.load_state_dict(
            {"epoch": self.position.epoch, "consumed_samples": self.position.consumed_samples}
        )
        return super().__iter__()


class PretrainDataModule(L.LightningDataModule):
    """Packed pretraining batches from prepared directories (``pretrain prepare``), blended by ``weights``.

    Args:
        data_dirs: prepared directories, each with ``train.bin/.idx`` and ``val.bin/.idx``.
        objective: duck-typed objective (``raw_length``, ``__call__(tokens (B, L), generators)`` with one
            ``torch.Generator`` per row).
        seq_len: model input length; samples hold ``objective.raw_length(seq_len)`` raw tokens.
        micro_batch_size: samples per batch per rank.
        weights: one positive weight per directory (normalised); default equal.
        num_workers, seed: DataLoader workers; the seed of the shuffle and of the objective.
        val_batches: validation batches per rank (default: every whole global batch of the val split).
        samples_per_epoch: training samples per epoch (default: all samples of all corpora).
        rank, world_size: data-parallel position when no trainer is attached (the trainer's otherwise).
        tokenizer: optional ``tokenizers.Tokenizer`` or path; each dir's ``meta.json`` must record it
            (same vocab size and, when recorded, the same tokenizer.json hash), else ValueError.
        schedule: a ``MixtureSchedule`` over the directories (in order): the training mix then changes with the
            optimizer step (``pretrain.datamodules.schedule``) and ``weights`` only blend validation. The state
            holds the schedules in force so far: resumed with another one, the steps before the checkpoint keep
            theirs (``SwitchedSchedule``).
        names: the sources' names, for ``tokens_per_source`` (default: the directory names).
        document_mask: samples carry their tokens' document ids (from each corpus's document lengths) and the
            objective keeps every document to itself (``pretrain.objectives.base``; ``docs/data.md``).
    """

    accumulate_grad_batches = (
        1  # micro-batches per optimizer step (``PretrainData`` sets it): a schedule's step
    )

    def __init__(
        self,
        data_dirs: str | Path | Sequence[str | Path],
        objective: Objective,
        *,
        seq_len: int,
        micro_batch_size: int,
        weights: Sequence[float] | None = None,
        num_workers: int = 0,
        seed: int = 0,
        val_batches: int | None = None,
        samples_per_epoch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        tokenizer: Tokenizer | str | os.PathLike | None = None,
        schedule: MixtureSchedule | None = None,
        names: Sequence[str] | None = None,
        document_mask: bool = False,
    ):
        super().__init__()
        self.data_dirs = (
            [Path(data_dirs)] if isinstance(data_dirs, (str, Path)) else list(map(Path, data_dirs))
        )
        if not self.data_dirs:
            raise ValueError("data_dirs is empty; give at least one directory written by `pretrain prepare`")
        for path in self.data_dirs:
            if not path.is_dir():
                raise FileNotFoundError(
                    f"prepared data directory {path} does not exist; create it with "
                    f"`pretrain prepare` (pretrain.datamodules.prepare) from your raw text first"
                )
        if weights is not None and len(weights) != len(self.data_dirs):
            raise ValueError(
                f"got {len(weights)} weights for {len(self.data_dirs)} data_dirs; give one per dir"
            )
        assert seq_len >= 1 and micro_batch_size >= 1, "checked by pretrain.config.validate"
        for name, value, low in [
            ("num_workers", num_workers, 0),
            ("seed", seed, 0),
            ("val_batches", 0 if val_batches is None else val_batches, 0),
        ]:
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not (callable(objective) and hasattr(objective, "raw_length")):
            raise ValueError(
                "objective must be callable and have raw_length(seq_len) (see pretrain.objectives.build)"
            )
        self.objective, self.seq_len, self.micro_batch_size = objective, seq_len, micro_batch_size
        self.weights, self.num_workers, self.seed = weights, num_workers, seed
        self.val_batches, self.samples_per_epoch = val_batches, samples_per_epoch
        if schedule is not None and schedule.num_sources != len(self.data_dirs):
            raise ValueError(
                f"the schedule weighs {schedule.num_sources} sources but there are {len(self.data_dirs)}"
            )
        self.schedule = schedule
        self.document_mask = document_mask
        if document_mask:
            if not getattr(objective, "document_mask", False):
                raise InputError(
                    f"objective {getattr(objective, 'name', type(objective).__name__)!r} cannot keep packed documents "
                    "apart (data.document_mask); set data.document_mask=false"
                )
            check_document_lengths(self.data_dirs)
        # (first step, schedule) of each schedule in force so far: more than one after a resume that changed it
        self.schedules: list[tuple[int, MixtureSchedule]] = [] if schedule is None else [(0, schedule)]
        self.names = list(names) if names is not None else [d.name for d in self.data_dirs]
        self._rank, self._world_size = rank, world_size
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        self.sample_length = int(objective.raw_length(seq_len))
        self.train_set: BlendedDataset | None = None
        self.val_set: BlendedDataset | None = None
        self.epoch, self.consumed_samples = 0, 0  # what the training loop has received
        self._loaded_epoch_size: int | None = None  # from a loaded state, checked once the data is open

    def _check_tokenizer(self, tokenizer: Tokenizer | str | os.PathLike) -> None:
        """The prepared token ids must come from ``tokenizer`` (``meta.json`` of ``pretrain prepare``)."""
        if not isinstance(tokenizer, Tokenizer):
            from pretrain.datamodules.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        sha256 = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        for path in self.data_dirs:
            if not (path / "meta.json").is_file():
                raise FileNotFoundError(
                    f"{path} has no meta.json; write the directory with `pretrain prepare`"
                )
            meta = json.loads((path / "meta.json").read_text())
            if meta.get("vocab_size") != vocab_size or meta.get("tokenizer_sha256", sha256) != sha256:
                raise InputError(
                    f"{path} was prepared with another tokenizer (vocab size {meta.get('vocab_size')}, this "
                    f"one has {vocab_size}); re-run `pretrain prepare` with this tokenizer or use the "
                    f"matching one"
                )

    # --- data-parallel layout -------------------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): the trainer's strategy's (a tensor-parallel group's ranks
        read the same batches), or the constructor's without a trainer."""
        if self.trainer is None:
            return self._rank, self._world_size
        return data_parallel_position(self.trainer)

    @property
    def rank(self) -> int:
        return self._position()[0]

    @property
    def sequence_shard(self) -> SequenceShard | None:
        """This rank's cut of every batch under context parallelism (the trainer's strategy's), else None."""
        rank, size = context_parallel_position(self.trainer) if self.trainer is not None else (0, 1)
        return SequenceShard(rank, size) if size > 1 else None

    @property
    def world_size(self) -> int:
        return self._position()[1]

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.micro_batch_size, self.world_size)

    @property
    def batches_per_epoch(self) -> int:
        """Training batches per rank per epoch."""
        return self._train().epoch_size // self.global_batch_size

    # --- datasets -------------------------------------------------------------------------------------
    def _corpora(self, split: str) -> list[PackedDataset]:
        """One packed corpus per directory; a directory prepared in tasks is its shards' concatenation."""
        from pretrain.datamodules.prepare import shard_documents, shard_tokens

        return [
            PackedDataset(
                shard_tokens(d, split),
                self.sample_length,
                name=str(d / split),
                documents=shard_documents(d, split) if self.document_mask else None,
            )
            for d in self.data_dirs
        ]

    def setup(self, stage: str | None = None) -> None:
        """Open the memory-mapped splits (cheap); ValueError if a corpus is smaller than one sample."""
        if stage in (None, "fit") and self.train_set is None:
            if self.schedule is not None:
                self.train_set = ScheduledBlend(
                    self._corpora(TRAIN),
                    SwitchedSchedule(self.schedules) if len(self.schedules) > 1 else self.schedule,
                    self.global_batch_size * self.accumulate_grad_batches,
                    seed=self.seed,
                    epoch_size=self.samples_per_epoch,
                )
            else:
                self.train_set = BlendedDataset(
                    self._corpora(TRAIN), self.weights, seed=self.seed, epoch_size=self.samples_per_epoch
                )
            self._check_loaded_state()
        if stage in (None, "fit", "validate") and self.val_set is None and self.val_batches != 0:
            try:
                val = self._corpora(VAL)
            except InputError as err:
                raise InputError(
                    f"{err} (or set trainer.limit_val_batches=0 to train without validation)"
                ) from err
            size = sum(map(len, val))
            if self.val_batches is not None:
                size = min(size, self.val_batches * self.global_batch_size)
            self.val_set = BlendedDataset(val, self.weights, seed=self.seed, shuffle=False, epoch_size=size)

    def _train(self) -> BlendedDataset:
        if self.train_set is None:
            self.setup("fit")
        assert self.train_set is not None
        return self.train_set

    def _loader(
        self, dataset: BlendedDataset, sampler: ShardedSampler, split: str, position: Any = None
    ) -> DataLoader:
        loader = DataLoader if position is None else ReceivedPositionLoader
        return loader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=ObjectiveCollate(
                self.objective, self.seed, dataset.epoch_size, split, self.sequence_shard
            ),
            pin_memory=torch.cuda.is_available(),
            **({} if position is None else {"position": position}),
        )

    def train_dataloader(self) -> Batches:
        """Each ``iter()`` starts at the next sample the training loop has not received (``epoch``,
        ``consumed_samples``)."""
        train = self._train()
        sampler = ResumableSampler(
            train.epoch_size, self.micro_batch_size, rank=self.rank, world_size=self.world_size
        )
        return self._loader(train, sampler, TRAIN, position=self)

    def val_dataloader(self) -> DataLoader | list:
        """Fixed-order validation batches (an empty list when ``val_batches == 0``)."""
        if self.val_batches == 0:
            return []
        if self.val_set is None:
            self.setup("validate")
        assert self.val_set is not None
        sampler = ShardedSampler(
            self.val_set.epoch_size, self.micro_batch_size, rank=self.rank, world_size=self.world_size
        )
        return self._loader(self.val_set, sampler, VAL)

    def tokens_per_source(self) -> dict[str, int]:
        """Training tokens each source has given the loop so far (all ranks), by source name."""
        train = self._train()
        counts = train.source_counts(self.epoch * train.epoch_size + self.consumed_samples)
        return {name: int(c) * self.sample_length for name, c in zip(self.names, counts)}

    # --- resume ---------------------------------------------------------------------------------------
    def advance(self, num_batches: int = 1) -> None:
        """Record that the training loop received ``num_batches`` more batches (on every rank); the count
        rolls over to the next epoch when an epoch is complete."""
        per_epoch = self.batches_per_epoch * self.global_batch_size
        for _ in range(num_batches):
            self.consumed_samples += self.global_batch_size
            if self.consumed_samples >= per_epoch:
                self.epoch, self.consumed_samples = self.epoch + 1, 0

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning hook, called once per batch right before ``training_step``: count training batches."""
        if self.trainer is not None and self.trainer.training:
            self.advance()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``seed``, ``epoch``, ``consumed_samples`` (global, received by the loop), ``epoch_size``; with a mixture
        schedule, ``schedules``: each one in force so far, from its first step on."""
        state: dict[str, Any] = {
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed_samples": self.consumed_samples,
        }
        if self.train_set is not None:
            state["epoch_size"] = self.train_set.epoch_size
        if self.schedules:
            state["schedules"] = [{"first_step": first, **s.spec()} for first, s in self.schedules]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict["seed"]) != self.seed:
            raise InputError(
                f"the data state was saved with seed={state_dict['seed']} but this datamodule has "
                f"seed={self.seed}; "
                f"resume with seed={state_dict['seed']} to continue the same sample order"
            )
        self.epoch, self.consumed_samples = int(state_dict["epoch"]), int(state_dict["consumed_samples"])
        self._loaded_epoch_size = state_dict.get("epoch_size")
        self._check_loaded_state()
        if self.schedule is not None and state_dict.get("schedules"):
            self._continue_schedules(state_dict["schedules"])

    def _continue_schedules(self, saved: list[dict[str, Any]]) -> None:
        """The checkpoint's schedules, then this one from the checkpoint's step on if it differs (the run's
        set-up refused that unless ``resume_allow=[data_schedule]``)."""
        assert self.schedule is not None
        schedules = [(int(s.pop("first_step")), MixtureSchedule(**s)) for s in map(dict, saved)]
        if schedules[-1][1].spec() != self.schedule.spec():
            train = self._train()
            assert isinstance(train, ScheduledBlend)  # a schedule's stream
            step = (self.epoch * train.epoch_size + self.consumed_samples) // train.samples_per_step
            schedules = [(first, s) for first, s in schedules if first < step] + [(step, self.schedule)]
        self.schedules = schedules
        self.train_set = None  # rebuilt over them
        self._train()

    def _check_loaded_state(self) -> None:
        """The loaded position is meaningless on other data: the epoch size must match."""
        if self.train_set is not None and self._loaded_epoch_size not in (None, self.train_set.epoch_size):
            raise InputError(
                f"the loaded data state has {self._loaded_epoch_size} samples per epoch but these data give "
                f"{self.train_set.epoch_size}; resume with the same data_dirs, seq_len, objective and "
                f"samples_per_epoch as the run that saved it"
            )
