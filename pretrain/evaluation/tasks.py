"""Evaluation tasks: YAML definitions, JSONL examples and their validation.

A task file is one YAML mapping (``configs/eval/copa.yaml``)::

    name: copa
    type: multiple_choice            # multiple_choice | schema | language_modeling | generation | perplexity
    path: ${data_root}/icl/llmfoundry/copa.jsonl
    num_fewshot: 0

``${data_root}`` is filled in by the caller (``--data-root`` / the recipe's ``data_root``), so task files
never hard-code where data lives. Example fields per type (one JSON object per line):

====================  ==============================================  =========================
type                  fields                                          metrics
====================  ==============================================  =========================
multiple_choice       ``query``, ``choices`` (list), ``gold`` (index)  acc, acc_norm
schema                ``context_options`` (list), ``continuation``,   acc
                      ``gold`` (index of the right context)
language_modeling     ``context``, ``continuation``                   acc (greedy), perplexity
generation            ``context``, ``answer`` (str or list of str)    exact_match
perplexity            ``text`` (JSONL) or a raw ``.txt`` file          word/byte/token perplexity,
                                                                      bits_per_byte
====================  ==============================================  =========================
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.config.compose import load_yaml
from pretrain.errors import InputError

TASK_TYPES = ("multiple_choice", "schema", "language_modeling", "generation", "perplexity")

# field name -> (accepted python types, description) per task type
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {
    "multiple_choice": {
        "query": ((str,), "string"),
        "choices": ((list,), "non-empty list of strings"),
        "gold": ((int,), "integer index into choices"),
    },
    "schema": {
        "context_options": ((list,), "non-empty list of strings"),
        "continuation": ((str,), "string"),
        "gold": ((int,), "integer index into context_options"),
    },
    "language_modeling": {"context": ((str,), "string"), "continuation": ((str,), "string")},
    "generation": {"context": ((str,), "string"), "answer": ((str, list), "string or list of strings")},
    "perplexity": {"text": ((str,), "string")},
}
_OPTIONS_KEY = {"multiple_choice": "choices", "schema": "context_options"}

Example = dict[str, Any]


@dataclass
class TaskConfig:
    """One evaluation task. ``fewshot_path`` defaults to ``path`` (the evaluated example is never a shot)."""

    name: str
    type: str
    path: str
    num_fewshot: int = 0
    fewshot_path: str | None = None
    target_delimiter: str = " "  # between a query and its answer
    fewshot_delimiter: str = "\n\n"  # after each shot
    description: str = ""  # prepended to every prompt
    limit: int | None = None  # evaluate only the first `limit` examples
    # generation
    until: list[str] | None = None  # stop sequences (default: [fewshot_delimiter]); EOS always stops
    max_new_tokens: int = 256
    ignore_case: bool = False
    strip: bool = True  # strip whitespace from the prediction before exact match
    # perplexity on a text file: its document convention, as in `pretrain prepare` (pretrain.datamodules.corpus): "file"
    # (default, lm-eval's: the whole file is one document), "line", "blank_line", "separator:S". Each document is
    # scored on its own after the prefix token, as training saw it after EOS: to read the text the way a corpus
    # was prepared, give its data.sources[].document here (the default differs from prepare's blank_line)
    document: str = "file"
    source: str = field(default="<dict>", repr=False)  # file the task was read from (for error messages)

    def __post_init__(self) -> None:
        where = f"task {self.name!r} ({self.source})"
        if self.type not in TASK_TYPES:
            raise InputError(f"{where}: type={self.type!r} is not one of {list(TASK_TYPES)}")
        if not isinstance(self.num_fewshot, int) or self.num_fewshot < 0:
            raise InputError(f"{where}: num_fewshot must be an integer >= 0, got {self.num_fewshot!r}")
        if self.num_fewshot and self.type == "perplexity":
            raise InputError(f"{where}: perplexity tasks take no shots; set num_fewshot: 0")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit <= 0):
            raise InputError(f"{where}: limit must be a positive integer or null, got {self.limit!r}")
        if self.type == "perplexity":
            from pretrain.datamodules.corpus import document_mode

            document_mode(self.document)
        if self.max_new_tokens <= 0:
            raise InputError(f"{where}: max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.until is not None and not all(isinstance(s, str) for s in self.until):
            raise InputError(f"{where}: until must be a list of strings, got {self.until!r}")

    @property
    def stop_sequences(self) -> list[str]:
        return list(self.until) if self.until is not None else [self.fewshot_delimiter]

    @property
    def metric_names(self) -> tuple[str, ...]:
        return {
            "multiple_choice": ("acc", "acc_norm"),
            "schema": ("acc",),
            "language_modeling": ("acc", "perplexity"),
            "generation": ("exact_match",),
            "perplexity": ("word_perplexity", "byte_perplexity", "bits_per_byte", "token_perplexity"),
        }[self.type]


def task_from_dict(raw: dict[str, Any], source: str = "<dict>") -> TaskConfig:
    """Build a ``TaskConfig``, naming unknown or missing keys."""
    allowed = {f.name for f in dataclasses.fields(TaskConfig)} - {"source"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise InputError(f"{source}: unknown task key(s) {unknown}; allowed keys: {sorted(allowed)}")
    missing = [k for k in ("name", "type", "path") if k not in raw]
    if missing:
        raise InputError(
            f"{source}: missing required task key(s) {missing} (every task needs name, type, path)"
        )
    return TaskConfig(**raw, source=source)


def load_task(
    path: str | Path, data_root: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> TaskConfig:
    """Read one task YAML, filling ``${data_root}`` and applying ``overrides`` (e.g. ``num_fewshot``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    cfg = load_yaml(path, "task file")
    if data_root is not None:
        cfg.data_root = str(data_root)
    try:
        raw = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a mapping's: a dict
    except OmegaConfBaseException as e:
        raise InputError(f"{path}: cannot resolve interpolation: {str(e).splitlines()[0]}") from None
    raw.pop("data_root", None)
    raw.update(overrides or {})
    return task_from_dict(raw, source=str(path))


def _validate(example: Any, task_type: str, where: str) -> Example:
    if not isinstance(example, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(example).__name__}")
    for key, (types, desc) in _FIELDS[task_type].items():
        if key not in example:
            raise InputError(
                f"{where}: missing key {key!r}; {task_type} examples need {sorted(_FIELDS[task_type])}"
            )
        value = example[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise InputError(f"{where}: {key!r} must be a {desc}, got {value!r}")
        if isinstance(value, list) and (not value or not all(isinstance(v, str) for v in value)):
            raise InputError(f"{where}: {key!r} must be a {desc}, got {value!r}")
    if task_type in _OPTIONS_KEY:
        n = len(example[_OPTIONS_KEY[task_type]])
        if not 0 <= example["gold"] < n:
            raise InputError(
                f"{where}: gold={example['gold']} is out of range for {n} {_OPTIONS_KEY[task_type]} "
                f"(valid: 0..{n - 1})"
            )
    return example


def load_examples(path: str | Path, task_type: str) -> list[Example]:
    """Validated examples of a JSONL file (or documents of a ``.txt`` file for perplexity tasks).

    Every problem is reported as ``file:line: ...`` before any model work starts.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (check the task's path and its data_root)")
    if task_type not in TASK_TYPES:
        raise InputError(f"unknown task type {task_type!r}; valid: {list(TASK_TYPES)}")
    examples: list[Example] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            examples.append(_validate(example, task_type, f"{path}:{lineno}"))
    if not examples:
        raise InputError(f"{path}: no examples found")
    return examples


def load_documents(path: str | Path, document: str = "file", limit: int | None = None) -> list[str]:
    """Raw-text documents for perplexity: a ``.jsonl`` file's ``text`` fields, or a text file cut by the
    ``document`` convention with the reader ``pretrain prepare`` uses (``pretrain.datamodules.corpus.iter_documents``)."""
    from pretrain.datamodules.corpus import Source, iter_documents

    path = Path(path)
    if path.suffix == ".jsonl":
        return [ex["text"] for ex in load_examples(path, "perplexity")][:limit]
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (check the task's path and its data_root)")
    docs = list(itertools.islice(iter_documents([Source("text", str(path))], document=document), limit))
    if not docs:
        raise InputError(f"{path}: no text found")
    return docs
