"""Text-to-text data for encoder-decoder finetuning (Raffel et al. 2020, T5): every task is source text -> target text.

GLUE as text, in the T5 paper's format (``t5.data.preprocessors.glue``)::

    sst2 sentence: it 's a charming journey .             -> positive
    rte sentence1: A man ... sentence2: A person ...      -> not_entailment
    stsb sentence1: ... sentence2: ...                    -> 3.8   (score rounded to the nearest 0.2)

and translation from line-aligned files (plain or gzipped, e.g. Multi30k ``train.de.gz`` / ``train.en.gz``) with a
task prefix (``translate German to English: ``). Batches: ``input_ids``, ``attention_mask`` (B, S) source + EOS;
``labels`` (B, T) target + EOS, padded with -100; ``decoder_input_ids`` (B, T) = labels shifted right behind the
decoder start token (T5: pad); ``targets``: the reference strings (for accuracy / BLEU of decoded outputs).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader

from pretrain.datamodules.finetune import ShardedExamplesDataModule, read_table, task_format
from pretrain.datamodules.tokenizer import TextEncoder
from pretrain.errors import InputError

IGNORE_INDEX = -100

# task -> (prompt field names for the text columns, label -> target word); None: regression (a number)
GLUE_TEXT: dict[str, tuple[tuple[str, ...], dict[str, str] | None]] = {
    "cola": (("sentence",), {"0": "unacceptable", "1": "acceptable"}),
    "sst2": (("sentence",), {"0": "negative", "1": "positive"}),
    "mrpc": (("sentence1", "sentence2"), {"0": "not_equivalent", "1": "equivalent"}),
    "qqp": (("question1", "question2"), {"0": "not_duplicate", "1": "duplicate"}),
    "qnli": (("question", "sentence"), {"entailment": "entailment", "not_entailment": "not_entailment"}),
    "rte": (("sentence1", "sentence2"), {"entailment": "entailment", "not_entailment": "not_entailment"}),
    "wnli": (("sentence1", "sentence2"), {"0": "not_entailment", "1": "entailment"}),
    "mnli": (("premise", "hypothesis"), {k: k for k in ("entailment", "neutral", "contradiction")}),
    "stsb": (("sentence1", "sentence2"), None),
}


def _task_key(task: str) -> str:
    key = task.lower().replace("-", "").replace("_", "")
    if key not in GLUE_TEXT:
        raise InputError(f"no text-to-text format for task {task!r}; known: {sorted(GLUE_TEXT)}")
    return key


def glue_pairs(path: str | os.PathLike, task: str) -> list[tuple[str, str]]:
    """(source, target) pairs of a GLUE TSV/JSONL file in T5's text format."""
    key = _task_key(task)
    fields, words = GLUE_TEXT[key]
    fmt = task_format(key)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found")
    columns, rows = read_table(path, fmt.header)
    missing = [c for c in (*fmt.text_columns, fmt.label_column) if c not in columns]
    if missing:
        raise InputError(
            f"{path}: missing column(s) {missing} for task {task!r}; available columns: {columns}"
        )
    pairs = []
    for line_no, row in enumerate(rows, 2 if fmt.header else 1):
        texts = " ".join(f"{f}: {row[c].strip()}" for f, c in zip(fields, fmt.text_columns, strict=True))
        label = str(row[fmt.label_column]).strip()
        if words is None:
            target = f"{round(float(label) * 5) / 5:.1f}"
        elif label in words:
            target = words[label]
        else:
            raise InputError(
                f"{path} line {line_no}: label {label!r} is not one of {sorted(words)} for {task!r}"
            )
        pairs.append((f"{key} {texts}", target))
    if not pairs:
        raise InputError(f"{path} has no examples")
    return pairs


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def parallel_pairs(
    source_file: str | os.PathLike, target_file: str | os.PathLike, prefix: str = ""
) -> list[tuple[str, str]]:
    """(prefix + source line, target line) from two line-aligned files; ValueError if they do not align."""
    sources, targets = _read_lines(Path(source_file)), _read_lines(Path(target_file))
    if len(sources) != len(targets):
        raise InputError(
            f"{source_file} has {len(sources)} lines but {target_file} has {len(targets)}: the files of a "
            "parallel corpus must be line-aligned"
        )
    if not sources:
        raise InputError(f"{source_file} is empty")
    return [(prefix + s.strip(), t.strip()) for s, t in zip(sources, targets, strict=True)]


class Text2TextCollate:
    """Pads sources with ``pad_id`` and targets with -100; builds decoder inputs (targets shifted right)."""

    def __init__(self, pad_id: int, decoder_start_id: int):
        self.pad_id, self.start_id = pad_id, decoder_start_id

    def __call__(self, examples: list[tuple[list[int], list[int], str]]) -> dict[str, Tensor | list[str]]:
        B = len(examples)
        S, T = max(len(s) for s, _, _ in examples), max(len(t) for _, t, _ in examples)
        batch = {
            "input_ids": torch.full((B, S), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros(B, S, dtype=torch.long),
            "labels": torch.full((B, T), IGNORE_INDEX, dtype=torch.long),
        }
        for b, (source, target, _) in enumerate(examples):
            batch["input_ids"][b, : len(source)] = torch.tensor(source)
            batch["attention_mask"][b, : len(source)] = 1
            batch["labels"][b, : len(target)] = torch.tensor(target)
        shifted = batch["labels"][:, :-1].masked_fill(batch["labels"][:, :-1] == IGNORE_INDEX, self.pad_id)
        start = torch.full((B, 1), self.start_id, dtype=torch.long)
        batch["decoder_input_ids"] = torch.cat([start, shifted], dim=1)
        return {**batch, "targets": [text for _, _, text in examples]}


class PackedText2TextCollate:
    """Source/target pairs packed into rows without padding (``pretrain.datamodules.unpadded``; a pair's source and
    target share a row, so its decoder cross-attends to its own source): the keys of ``Text2TextCollate`` plus
    ``document_ids``, ``position_ids`` (R, S) and ``decoder_document_ids``, ``decoder_position_ids`` (R, T);
    decoder inputs start with the decoder start token in every pair."""

    def __init__(self, pad_id: int, decoder_start_id: int):
        self.pad_id, self.start_id = pad_id, decoder_start_id

    def __call__(self, examples: list[tuple[list[int], list[int], str]]) -> dict[str, Tensor | list[str]]:
        from pretrain.datamodules.unpadded import first_fit, pack
        from pretrain.objectives.base import shift_right

        sources, targets = [s for s, _, _ in examples], [t for _, t, _ in examples]
        S, T = max(map(len, sources)), max(map(len, targets))
        rows = first_fit([[len(s), len(t)] for s, t in zip(sources, targets, strict=True)], [S, T])
        encoder, decoder = pack(sources, rows, S, self.pad_id), pack(targets, rows, T, IGNORE_INDEX)
        labels = decoder["tokens"]
        decoder_inputs = shift_right(labels, self.start_id, self.pad_id)
        decoder_inputs[(decoder["position_ids"] == 0) & (decoder["document_ids"] >= 0)] = self.start_id
        return {
            "input_ids": encoder["tokens"],
            "attention_mask": (encoder["document_ids"] >= 0).long(),
            "document_ids": encoder["document_ids"],
            "position_ids": encoder["position_ids"],
            "labels": labels,
            "decoder_input_ids": decoder_inputs,
            "decoder_attention_mask": (decoder["document_ids"] >= 0).long(),
            "decoder_document_ids": decoder["document_ids"],
            "decoder_position_ids": decoder["position_ids"],
            "targets": [text for _, _, text in examples],
        }


class Text2TextDataModule(ShardedExamplesDataModule):
    """(source, target) text pairs -> padded encoder-decoder batches.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``; texts are encoded by ``TextEncoder`` (special-token strings stay
            text, no post-processor), then ``eos_id`` is appended (T5 ends sources and targets with ``</s>``).
        train, val: lists of (source, target) pairs (``glue_pairs`` / ``parallel_pairs``).
        pad_id, eos_id, decoder_start_id: token ids (T5: pad = decoder start).
        max_source_length, max_target_length: token budgets including EOS (longer texts are truncated).
        unpadded: training batches packed without padding (``PackedText2TextCollate``); validation batches stay
            padded (they are decoded).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        train: list[tuple[str, str]],
        val: list[tuple[str, str]] | None = None,
        *,
        pad_id: int,
        eos_id: int,
        decoder_start_id: int,
        max_source_length: int = 128,
        max_target_length: int = 64,
        micro_batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        unpadded: bool = False,
    ):
        super().__init__()
        if min(max_source_length, max_target_length) < 2 or micro_batch_size < 1:
            raise ValueError(
                "max_source_length and max_target_length must be >= 2 (a token and EOS), micro_batch_size >= 1; "
                f"got {max_source_length}, {max_target_length}, {micro_batch_size}"
            )
        self.encoder, self.eos_id = TextEncoder(tokenizer), eos_id
        self.max_source_length, self.max_target_length = max_source_length, max_target_length
        self.pairs = {"train": train} | ({"val": val} if val else {})
        self.collate = Text2TextCollate(pad_id, decoder_start_id)
        self.train_collate = PackedText2TextCollate(pad_id, decoder_start_id) if unpadded else self.collate
        self.micro_batch_size, self.num_workers, self.seed = micro_batch_size, num_workers, seed
        self.examples: dict[str, list[tuple[list[int], list[int], str]]] = {}

    def _encode(self, texts: list[str], budget: int) -> list[list[int]]:
        return [ids[: budget - 1] + [self.eos_id] for ids in self.encoder(texts)]

    def setup(self, stage: str | None = None) -> None:
        for split, pairs in self.pairs.items():
            if split not in self.examples:
                sources = self._encode([s for s, _ in pairs], self.max_source_length)
                targets = self._encode([t for _, t in pairs], self.max_target_length)
                self.examples[split] = list(zip(sources, targets, [t for _, t in pairs], strict=True))

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self.examples:
            self.setup("fit")
        return self.sharded_loader(
            self.examples[split], shuffle, self.train_collate if shuffle else self.collate
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", shuffle=False) if "val" in self.pairs else []
