"""The import graph is layered: every module sits on a floor, imports only from its own floor or below, and no
modules import each other in a circle (lazy imports inside functions count too). Read from the source's AST
(no module is imported), in well under a second."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# top-level folders installed inside the package (setup.py's package_dir)
MAPPED = {"objectives": "pretrain.objectives", "datamodules": "pretrain.datamodules"}

# Floors, bottom up. A module's floor is that of the longest prefix naming it.
FLOORS: list[tuple[str, ...]] = [
    # 0: no project imports but each other: errors, atomic writes and locks, unpooled memory, shims of private
    # APIs, YAML composition
    ("pretrain.errors", "pretrain.io", "pretrain.memory", "pretrain.compat", "pretrain.config.compose"),
    # 1: the pieces: objectives, data, parallel layouts, models
    ("pretrain.objectives", "pretrain.datamodules", "pretrain.parallel", "pretrain.models"),
    # 2: the run's schema and the optimizer built from it
    ("pretrain.config", "pretrain.optim"),
    # 3: checkpoints: read, written, converted and resumed by everything above
    ("pretrain.checkpoint",),
    # 4: evaluation of a model or checkpoint; Lightning strategies (which write checkpoints)
    ("pretrain.evaluation", "pretrain.compat.lightning"),
    # 5: the training step, its Trainer and callbacks
    ("pretrain.training",),
    # 6: what runs training: finetuning, baselines, scaling-law ladders
    ("pretrain.finetuning", "pretrain.baselines", "pretrain.ladder"),
    # 7: the command line
    ("pretrain.cli", "pretrain.__main__", "pretrain"),
]


@functools.cache
def module_files() -> dict[str, Path]:
    files = {}
    for root in ("pretrain", *MAPPED):
        for path in (REPO_ROOT / root).rglob("*.py"):
            if path.is_relative_to(REPO_ROOT / "pretrain") and any(
                (REPO_ROOT / "pretrain" / name) in path.parents for name in MAPPED
            ):
                continue  # the same files again through pretrain/objectives -> ../objectives
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[0] in MAPPED:
                parts = [*MAPPED[parts[0]].split("."), *parts[1:]]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """``{module: the project modules it imports}`` (``from package import submodule`` names the submodule)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def floor(module: str) -> int:
    best = max(
        ((len(prefix), level) for level, prefixes in enumerate(FLOORS) for prefix in prefixes
         if module == prefix or module.startswith(prefix + ".")),
        default=None,
    )  # fmt: skip
    assert best is not None, f"{module} is on no floor: add its package to FLOORS"
    return best[1]


def test_no_import_runs_back_up_a_floor():
    graph = import_graph()
    upward = [
        f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if floor(b) > floor(a)
    ]
    assert not upward, "\n".join(upward)


def test_no_circle_of_imports():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_floors_name_every_package():
    for module in module_files():
        floor(module)
