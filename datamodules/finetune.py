"""``FinetuneDataModule``: labelled sentences or sentence pairs (GLUE layout) -> dynamically padded batches.

Files are TSV (GLUE's layout: tab-separated, a header row, no quoting; headerless files such as CoLA name
their columns "0", "1", ... by position), CSV (``.csv``: comma-separated, RFC 4180 quoting) or JSON Lines (one
object per line). A task names its text column(s)
and its label column (``GLUE_TASKS`` holds the GLUE defaults; any of them can be overridden).

Texts are encoded by ``TextEncoder`` (a text spelling ``[SEP]`` or ``</s>`` stays that text); encoding follows BERT: ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]`` with ``token_type_ids`` 0 for the first
segment and 1 for the second, truncated longest-first to ``max_length`` (what ``transformers`` tokenizers do
with ``truncation=True``). The template is a ``tokenizers`` ``TemplateProcessing`` string (``$A``, ``$B``,
special tokens by name, ``:1`` sets the type id); by default ``{cls} $A {sep}`` / ``{cls} $A {sep} $B:1
{sep}:1`` with the tokenizer's cls/sep tokens (roles of ``pretrain.datamodules.special_tokens``). Batches are padded
to their longest row: ``input_ids``, ``attention_mask``, ``token_type_ids`` ``(B, T)`` and ``labels``
``(B,)`` (class ids as int64, or float32 scores for regression); or, ``unpadded``, packed into rows without
padding (``PackedCollate``, ``pretrain.datamodules.unpadded``).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from pretrain.datamodules.special_tokens import special_token_id
from pretrain.errors import InputError


@dataclass(frozen=True)
class TaskFormat:
    """Where the texts and the label sit in a file, and whether the label is a class or a score."""

    text_columns: tuple[str, ...]  # one (single sentence) or two (sentence pair)
    label_column: str
    regression: bool = False
    header: bool = True  # TSV only: without a header, columns are named "0", "1", ... by position


GLUE_TASKS: dict[str, TaskFormat] = {
    "cola": TaskFormat(("3",), "1", header=False),
    "sst2": TaskFormat(("sentence",), "label"),
    "mrpc": TaskFormat(("#1 String", "#2 String"), "Quality"),
    "stsb": TaskFormat(("sentence1", "sentence2"), "score", regression=True),
    "qqp": TaskFormat(("question1", "question2"), "is_duplicate"),
    "mnli": TaskFormat(("sentence1", "sentence2"), "gold_label"),
    "qnli": TaskFormat(("question", "sentence"), "label"),
    "rte": TaskFormat(("sentence1", "sentence2"), "label"),
    "wnli": TaskFormat(("sentence1", "sentence2"), "label"),
}


def task_format(task: str) -> TaskFormat:
    """GLUE defaults for ``task`` ("SST-2", "sst2", "STS-B", ... are all accepted)."""
    key = task.lower().replace("-", "").replace("_", "")
    if key not in GLUE_TASKS:
        raise InputError(
            f"unknown task {task!r}; known: {sorted(GLUE_TASKS)} (or give text_columns/label_column)"
        )
    return GLUE_TASKS[key]


def read_table(path: Path, header: bool = True) -> tuple[list[str], list[dict]]:
    """``(column names, rows)`` of a TSV, CSV or JSONL file; ValueError names the file and line of a bad row."""
    rows: list[dict] = []
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise InputError(f"{path} line {line_no}: not valid JSON ({err})") from err
        columns = list(dict.fromkeys(key for row in rows for key in row))
        return columns, rows
    comma = path.suffix == ".csv"  # RFC 4180 quoting; GLUE's .tsv files quote nothing
    with open(path, encoding="utf-8-sig", newline="") as f:  # utf-8-sig: MRPC starts with a BOM
        reader = csv.reader(f) if comma else csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        lines = [line for line in reader if line]
    if not lines:
        return [], []
    columns = lines[0] if header else [str(i) for i in range(len(lines[0]))]
    for line_no, fields in enumerate(lines[1:] if header else lines, 2 if header else 1):
        if len(fields) != len(columns):
            raise InputError(
                f"{path} line {line_no}: {len(fields)} {'comma' if comma else 'tab'}-separated fields, expected "
                f"{len(columns)}"
            )
        rows.append(dict(zip(columns, fields, strict=True)))
    return columns, rows


def _label_order(labels: set[str]) -> list[str]:
    """Class names in a stable order: numerically if they are all integers ("0" < "2" < "10")."""
    try:
        return sorted(labels, key=int)
    except ValueError:
        return sorted(labels)


def _template(tokenizer: Tokenizer, pair: bool, template: str | None, overrides: dict[str, str] | None):
    if template is None:
        cls, sep = (tokenizer.id_to_token(special_token_id(tokenizer, r, overrides)) for r in ("cls", "sep"))
        template = f"{cls} $A {sep} $B:1 {sep}:1" if pair else f"{cls} $A {sep}"
    pieces = [p.rsplit(":", 1)[0] if p.rsplit(":", 1)[-1].isdigit() else p for p in template.split()]
    if sorted(p for p in pieces if p.startswith("$")) != (["$A", "$B"] if pair else ["$A"]):
        raise InputError(f"template {template!r} must contain {'$A and $B' if pair else '$A'} exactly once")
    specials = []
    for token in dict.fromkeys(p for p in pieces if not p.startswith("$")):
        if tokenizer.token_to_id(token) is None:
            raise InputError(
                f"template token {token!r} is not in the tokenizer; fix the template or the tokenizer"
            )
        specials.append((token, tokenizer.token_to_id(token)))
    if pair:  # TemplateProcessing requires a single-sequence form too; pair data never uses it
        return TemplateProcessing(single="$A", pair=template, special_tokens=specials)
    return TemplateProcessing(single=template, special_tokens=specials)


class ShardSampler(Sampler[int]):
    """Positions ``rank, rank + W, ...`` of ``size`` in order: every example evaluated once over the W ranks
    (DistributedSampler would pad with repeats). Every rank yields ``ceil(size / W)`` positions: the missing ones
    are ``size + j``, padding (``PaddedExamples``) whose outputs are discarded -- so every rank runs the same
    number of forward passes, which sharded strategies (FSDP, ZeRO-3: a collective per forward) need."""

    def __init__(self, size: int, rank: int, world_size: int):
        self.indices = list(range(rank, size, world_size))
        self.indices += range(size, size + -(-size // world_size) - len(self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


class Padding(tuple):
    """``(example,)``: a stand-in for a position past the end of the data (``ShardSampler``)."""


class PaddedExamples(Dataset):
    """``examples`` read at any position; positions past the end give ``Padding`` of an example."""

    def __init__(self, examples: list):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Any:
        return (
            self.examples[i] if i < len(self.examples) else Padding((self.examples[i % len(self.examples)],))
        )


class MarkPadding:
    """``collate`` of the real and padding examples alike, plus ``real`` (B,) bool: False for padding."""

    def __init__(self, collate: Any):
        self.collate = collate

    def __call__(self, examples: list) -> dict[str, Any]:
        real = [not isinstance(e, Padding) for e in examples]
        batch = self.collate([e if r else e[0] for e, r in zip(examples, real, strict=True)])
        batch["real"] = torch.tensor(real)
        return batch


class TrainOrder(Sampler[int]):
    """Rank r's training positions of ``epoch``: the permutation seeded by ``(seed, epoch)``
    (``DistributedSampler``, drop_last), from the ``start``-th on (``set_position``: resume mid-epoch)."""

    def __init__(self, size: int, rank: int, world_size: int, seed: int):
        self.order: DistributedSampler[int] = DistributedSampler(
            range(size),  # type: ignore[arg-type]  # torch annotates a Dataset; the sampler reads its length only
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.order.set_epoch(epoch)
        self.start = start

    def __len__(self) -> int:
        """Positions this rank reads in a whole epoch."""
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.order)[self.start :])


class ReceivedBatchesLoader(DataLoader):
    """A training ``DataLoader`` whose every ``iter()`` starts after the batches the training loop has received
    (``position.epoch``, ``position.batches``), not where its sampler or workers had read ahead to."""

    def __init__(self, *args: Any, position: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.position = position

    def __iter__(self) -> Any:
        assert isinstance(self.sampler, TrainOrder)
        self.sampler.set_position(self.position.epoch, self.position.batches * self.batch_size)
        return super().__iter__()


class ShardedExamplesDataModule(L.LightningDataModule):
    """Examples in memory, sharded over the data-parallel ranks, with an exact mid-epoch resume.

    Training: rank r reads positions r, r + W, ... of a permutation seeded by ``(seed, epoch)``: global batch t
    of W ranks with micro-batch b holds the examples of batch t of one rank with batch W b. Evaluation: file
    order, each example once (``ShardSampler``; batches carry ``real``). The state saved in checkpoints is
    ``(seed, epoch, batches)``: the training batches the loop has received in the epoch, counted in
    ``on_after_batch_transfer`` (as ``pretrain.datamodules.pretrain.PretrainDataModule`` does). Subclasses set
    ``micro_batch_size``, ``num_workers``, ``seed``. Use with ``Trainer(use_distributed_sampler=False)``."""

    micro_batch_size: int
    num_workers: int
    seed: int

    def __init__(self) -> None:
        super().__init__()
        self.epoch, self.batches = 0, 0
        self.epoch_batches = 0  # training batches per rank per epoch (set with the training loader)

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def sharded_loader(self, examples: list, shuffle: bool, collate: Any) -> DataLoader:
        rank, world = self._ranks()
        options: dict[str, Any] = {"batch_size": self.micro_batch_size, "num_workers": self.num_workers}
        if shuffle:
            order = TrainOrder(len(examples), rank, world, self.seed)
            self.epoch_batches = -(-len(order) // self.micro_batch_size)
            return ReceivedBatchesLoader(
                examples, sampler=order, collate_fn=collate, position=self, **options
            )
        shards = ShardSampler(len(examples), rank, world)
        return DataLoader(
            PaddedExamples(examples), sampler=shards, collate_fn=MarkPadding(collate), **options
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning hook, called once per batch right before ``training_step``: count training batches."""
        if self.trainer is not None and self.trainer.training:
            self.batches += 1
            if self.batches >= self.epoch_batches:
                self.epoch, self.batches = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if int(state_dict["seed"]) != self.seed:
            raise InputError(
                f"the data state was saved with seed={state_dict['seed']} but this run has seed={self.seed}; "
                f"resume with seed={state_dict['seed']} to continue the same example order"
            )
        self.epoch, self.batches = int(state_dict["epoch"]), int(state_dict["batches"])


class PaddingCollate:
    """Pads ``(input_ids, token_type_ids, label)`` examples to the longest in the batch."""

    def __init__(self, pad_id: int, regression: bool):
        self.pad_id, self.regression = pad_id, regression

    def __call__(self, examples: list[tuple[list[int], list[int], float | int]]) -> dict[str, Tensor]:
        width = max(len(ids) for ids, _, _ in examples)
        batch = {
            "input_ids": torch.full((len(examples), width), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
            "token_type_ids": torch.zeros(len(examples), width, dtype=torch.long),
        }
        for b, (ids, types, _) in enumerate(examples):
            batch["input_ids"][b, : len(ids)] = torch.tensor(ids)
            batch["attention_mask"][b, : len(ids)] = 1
            batch["token_type_ids"][b, : len(ids)] = torch.tensor(types)
        dtype = torch.float32 if self.regression else torch.long
        batch["labels"] = torch.tensor([label for _, _, label in examples], dtype=dtype)
        return batch


class PackedCollate:
    """``(input_ids, token_type_ids, label)`` examples packed into rows without padding
    (``pretrain.datamodules.unpadded``): ``input_ids``, ``attention_mask``, ``token_type_ids``, ``document_ids``,
    ``position_ids``, ``example_ids`` (R, C); ``example_first`` / ``example_last`` (B,) flat indices of each
    example's first and last token; ``labels`` (B,) in the examples' order."""

    def __init__(self, pad_id: int, regression: bool):
        self.pad_id, self.regression = pad_id, regression

    def __call__(self, examples: list[tuple[list[int], list[int], float | int]]) -> dict[str, Tensor]:
        from pretrain.datamodules.unpadded import first_and_last, first_fit, pack

        ids = [e[0] for e in examples]
        width = max(map(len, ids))
        rows = first_fit([[len(x)] for x in ids], [width])
        packed = pack(ids, rows, width, self.pad_id)
        first, last = first_and_last(packed["example_ids"], len(examples))
        dtype = torch.float32 if self.regression else torch.long
        return {
            "input_ids": packed["tokens"],
            "attention_mask": (packed["document_ids"] >= 0).long(),
            "token_type_ids": pack([e[1] for e in examples], rows, width, 0)["tokens"],
            "document_ids": packed["document_ids"],
            "position_ids": packed["position_ids"],
            "example_ids": packed["example_ids"],
            "example_first": first,
            "example_last": last,
            "labels": torch.tensor([label for _, _, label in examples], dtype=dtype),
        }


class FinetuneDataModule(ShardedExamplesDataModule):
    """Sentence(-pair) classification / regression batches from TSV or JSONL files.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a path for ``pretrain.datamodules.tokenizer.load_tokenizer``.
        train_file, val_file: labelled files; labels of ``val_file`` must occur in ``train_file``.
        task: GLUE task name for the column defaults (``GLUE_TASKS``); ``text_columns``, ``label_column``,
            ``regression`` and ``header`` override them (and are required without a task).
        template: a ``TemplateProcessing`` string (see the module docstring); ``special_tokens`` maps roles
            (cls, sep, pad) to token strings for tokenizers with other names (e.g. BERT's "[CLS]").
        max_length: longest encoded example (truncated longest-first); micro_batch_size: examples per batch.
        unpadded: pack each batch's examples into rows without padding (``PackedCollate``) instead of padding
            them to the longest.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike,
        train_file: str | os.PathLike,
        val_file: str | os.PathLike | None = None,
        *,
        task: str | None = None,
        text_columns: Sequence[str] | None = None,
        label_column: str | None = None,
        regression: bool | None = None,
        header: bool | None = None,
        template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        max_length: int = 128,
        micro_batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        unpadded: bool = False,
    ):
        super().__init__()
        self.unpadded = unpadded
        if task is not None:
            fmt = task_format(task)
        elif text_columns is not None and label_column is not None:
            fmt = TaskFormat(tuple(text_columns), label_column)
        else:
            raise InputError(
                f"give task= (one of {sorted(GLUE_TASKS)}) or both text_columns and label_column"
            )
        overrides: dict[str, Any] = {
            "text_columns": text_columns and tuple(text_columns),
            "label_column": label_column,
        }
        overrides |= {"regression": regression, "header": header}
        self.format = replace(fmt, **{k: v for k, v in overrides.items() if v is not None})
        if len(self.format.text_columns) not in (1, 2):
            raise InputError(f"text_columns must name 1 or 2 columns, got {self.format.text_columns}")
        self.files = {"train": Path(train_file)} | ({"val": Path(val_file)} if val_file is not None else {})
        for path in self.files.values():
            if not path.is_file():
                raise FileNotFoundError(f"data file {path} not found")
        for name, value in [("max_length", max_length), ("micro_batch_size", micro_batch_size)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        from pretrain.datamodules.tokenizer import TextEncoder, load_tokenizer

        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        pair = len(self.format.text_columns) == 2
        self.encoder = TextEncoder(tokenizer)  # special-token strings in the texts stay text
        self.tokenizer = self.encoder.tokenizer  # its own copy: we set its template and truncation
        self.tokenizer.post_processor = _template(self.tokenizer, pair, template, special_tokens)
        added = self.tokenizer.post_processor.num_special_tokens_to_add(pair)
        if max_length <= added:
            raise InputError(
                f"max_length={max_length} leaves no room for text: the template adds {added} special tokens "
                f"per example; raise max_length above {added}"
            )
        self.tokenizer.enable_truncation(max_length)  # longest-first
        self.tokenizer.no_padding()
        self.pad_id = special_token_id(self.tokenizer, "pad", special_tokens)
        self.micro_batch_size, self.num_workers, self.seed = micro_batch_size, num_workers, seed
        self.label_names: list[str] | None = None  # classes in id order (None for regression)
        self.examples: dict[str, list[tuple[list[int], list[int], float | int]]] = {}

    @property
    def num_labels(self) -> int:
        """Output width of the head: the number of classes, or 1 for regression."""
        if self.format.regression:
            return 1
        if self.label_names is None:
            self.setup("fit")
        assert self.label_names is not None
        return len(self.label_names)

    def _read(self, split: str) -> tuple[list, list]:
        """Texts (str, or (str, str) pairs) and raw labels of one split, columns checked."""
        path, fmt = self.files[split], self.format
        columns, rows = read_table(path, fmt.header)
        if not columns:
            raise InputError(f"{path} is empty; give a file with a header row and one example per line")
        missing = [c for c in (*fmt.text_columns, fmt.label_column) if c not in columns]
        if missing:
            raise InputError(
                f"{path}: missing column(s) {missing}; available columns: {columns}; set text_columns / "
                f"label_column (or header=False for a file without a header row)"
            )
        if not rows:
            raise InputError(f"{path} has no examples")
        texts = [tuple(str(row[c]) for c in fmt.text_columns) for row in rows]
        return [t[0] if len(t) == 1 else t for t in texts], [row[fmt.label_column] for row in rows]

    def _label_ids(self, split: str, labels: list) -> list[float | int]:
        path = self.files[split]
        if self.format.regression:
            try:
                return [float(x) for x in labels]
            except ValueError as err:
                raise InputError(f"{path}: regression labels must be numbers ({err})") from err
        labels = [str(x) for x in labels]
        if self.label_names is None:
            self.label_names = _label_order(set(labels))
            if len(self.label_names) < 2:
                raise InputError(
                    f"{path}: every example has label {self.label_names[0]!r}; a classifier needs two or more "
                    f"classes (check the file and label_column, or set regression=true for a numeric target)"
                )
        index = {name: i for i, name in enumerate(self.label_names)}
        unseen = sorted(set(labels) - index.keys())
        if unseen:
            raise InputError(
                f"{path}: label(s) {unseen} do not occur in the training file {self.files['train']} "
                f"(its labels: {self.label_names}); fix the file or the label_column"
            )
        return [index[x] for x in labels]

    def setup(self, stage: str | None = None) -> None:
        """Read, check and tokenize every split (train first: it defines the label set)."""
        for split in self.files:
            if split not in self.examples:
                texts, labels = self._read(split)
                label_ids = self._label_ids(split, labels)
                encodings = self.encoder.encodings(texts)
                self.examples[split] = [
                    (e.ids, e.type_ids, y) for e, y in zip(encodings, label_ids, strict=True)
                ]

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self.examples:
            self.setup("fit")
        kind = PackedCollate if self.unpadded else PaddingCollate
        return self.sharded_loader(self.examples[split], shuffle, kind(self.pad_id, self.format.regression))

    def train_dataloader(self) -> DataLoader:
        """Shuffled by ``seed`` and sharded over the data-parallel ranks (see ``ShardedExamplesDataModule``)."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        """File order; an empty list without ``val_file``."""
        return self._loader("val", shuffle=False) if "val" in self.files else []
