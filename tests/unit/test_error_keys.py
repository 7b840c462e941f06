"""Every recipe key an error message names exists in the schema of the verb that prints it (issue 31): a message
telling the user to set ``data.batch_size`` where there is none sends them on a hunt. The messages are read from
the source (every string literal with a space in it but docstrings; f-strings by their literal parts), the keys they name resolved
against the dataclass schemas of ``fit``, ``finetune``, ``evaluate`` and ``baseline``."""

from __future__ import annotations

import ast
import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest

from pretrain.baselines.config import BASELINES
from pretrain.config import RunConfig
from pretrain.errors import MEMORY_FIX, OS_FIX
from pretrain.evaluation.config import EvalConfig
from pretrain.finetuning.config import FinetuneConfig

ROOT = Path(__file__).resolve().parents[2]
BASELINE_SECTION = typing.Union[tuple(BASELINES.values())]  # noqa: UP007  (a union of the kinds' dataclasses)
SCHEMAS = {
    "fit": RunConfig,
    "finetune": FinetuneConfig,
    "evaluate": EvalConfig,
    "baseline": (RunConfig, {"baselines": BASELINE_SECTION}),
}
# which verbs print the messages of a module (by path prefix; the first match wins)
VERBS_OF = [
    ("pretrain/finetuning/", ("finetune",)),
    ("datamodules/finetune.py", ("finetune",)),
    ("datamodules/text2text.py", ("finetune",)),
    ("pretrain/evaluation/", ("evaluate", "fit")),  # in-loop evaluation runs inside fit
    ("pretrain/baselines/", ("baseline",)),
    ("pretrain/models/rnn.py", ("baseline",)),
    ("pretrain/models/word_vectors.py", ("baseline",)),
    ("objectives/sgns.py", ("baseline",)),
    ("objectives/glove.py", ("baseline",)),
    ("pretrain/config/run.py", ("fit", "finetune", "baseline")),
    ("pretrain/errors.py", ("fit", "finetune", "baseline")),
    ("pretrain/training/strategies.py", ("fit", "finetune")),
    ("pretrain/training/trainer.py", ("fit", "finetune")),
    ("pretrain/training/", ("fit",)),
    ("pretrain/models/", ("fit", "finetune")),
    ("datamodules/", ("fit", "baseline")),
    ("objectives/", ("fit", "baseline")),
    ("pretrain/", ("fit", "finetune", "evaluate", "baseline")),
]
FILE_SUFFIXES = (
    "json",
    "yaml",
    "yml",
    "safetensors",
    "bin",
    "idx",
    "txt",
    "ckpt",
    "pt",
    "npy",
    "csv",
    "png",
    "py",
)


def _fields(tp):
    """``{field: type}`` of a dataclass, a union of them, or a mapping given as such; None for a leaf type."""
    if isinstance(tp, tuple):  # (dataclass, extra sections)
        return {**_fields(tp[0]), **tp[1]}
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        merged = {}
        for arg in typing.get_args(tp):
            merged |= _fields(arg) or {}
        return merged or None
    if dataclasses.is_dataclass(tp):
        return typing.get_type_hints(tp)
    return None


def resolves(schema, key: str) -> bool:
    """``key`` (``a.b.c``, list items as ``a[0].b`` or ``a[].b``) names a field of ``schema``; a mapping field
    (``objective.options``, ``tokenizer.special_tokens``) takes any key below it."""
    tp = schema
    for part in re.sub(r"\[[^\]]*\]", "", key).split("."):
        while typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        if typing.get_origin(tp) is dict or tp is typing.Any:
            return True
        fields = _fields(tp)
        if fields is None or part not in fields:
            return False
        tp = fields[part]
    return True


def sections(schema) -> set[str]:
    return {
        name
        for name, tp in _fields(schema).items()
        if _fields(tp) is not None or typing.get_origin(tp) is dict
    }


ALL_SECTIONS = set().union(*(sections(s) for s in SCHEMAS.values()))
KEY = re.compile(
    r"(?<![\w./-])("
    + "|".join(sorted(ALL_SECTIONS))
    + r")((?:\[[^\]\s]*\])?(?:\.[A-Za-z_]\w*(?:\[[^\]\s]*\])?)+)"
)


def _literal_parts(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # f-string: its literal parts, a placeholder for each value
        return "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
    return None


def messages(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in docstrings or isinstance(getattr(node, "_parent", None), ast.JoinedStr):
            continue
        text = _literal_parts(node)
        if text is not None and " " in text:  # a message (weight and metric names have no spaces)
            found.append((node.lineno, text))
    return found


def named_keys(text: str) -> list[str]:
    keys = []
    for match in KEY.finditer(text):
        key = match.group(0)
        end = match.end()
        if end < len(text) and text[end] == "\0":  # cut by an f-string value: the key's tail is not literal
            key = key.rsplit(".", 1)[0]
        if key.rsplit(".", 1)[-1] in FILE_SUFFIXES or "\0" in key.split(".", 1)[0]:
            continue
        keys.append(key.replace("\0", ""))
    return keys


def verbs_of(relative: str) -> tuple[str, ...]:
    return next(verbs for prefix, verbs in VERBS_OF if relative.startswith(prefix))


def sources() -> list[Path]:
    return sorted(p for d in ("pretrain", "datamodules", "objectives") for p in (ROOT / d).rglob("*.py"))


def test_every_key_a_message_names_exists_in_its_verbs_schema():
    wrong = []
    for path in sources():
        relative = str(path.relative_to(ROOT))
        schemas = [SCHEMAS[v] for v in verbs_of(relative)]
        for line, text in messages(path):
            for key in named_keys(text):
                if not any(resolves(s, key) for s in schemas):
                    wrong.append(f"{relative}:{line}: {key} (verbs {verbs_of(relative)})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("verb", ["fit", "finetune", "baseline"])
def test_the_memory_fix_of_each_verb_names_its_own_keys(verb):
    keys = named_keys(MEMORY_FIX[verb])
    assert keys and all(resolves(SCHEMAS[verb], k) for k in keys), keys


def test_the_scan_finds_a_wrong_key():
    """The scan itself: ``data.batch_size`` (finetune's old memory fix) does not resolve, its right name does."""
    assert named_keys("lower data.batch_size or data.max_length (see tokenizer.json)") == [
        "data.batch_size",
        "data.max_length",
    ]
    assert not resolves(FinetuneConfig, "data.batch_size") and resolves(
        FinetuneConfig, "data.micro_batch_size"
    )
    assert resolves(RunConfig, "data.sources[0].text") and resolves(RunConfig, "objective.options.anything")
    assert named_keys("trainer.\0 must be >= 1") == [] and OS_FIX
