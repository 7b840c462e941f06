"""One way to read every verb's YAML: compose a recipe from config pieces, apply ``key=value`` overrides, and
check the result against a dataclass schema.

A recipe lists its *pieces* and overrides some values::

    defaults: [model/gpt-tiny, objective/clm, data/shakespeare, optim/adamw, trainer/cpu, logger/default]
    name: gpt-tiny
    trainer: {max_steps: 300}

A recipe is a path or the name of a shipped one (``gpt-tiny``). ``model/gpt-tiny`` is
``configs/model/gpt-tiny.yaml`` placed under the ``model`` key; ``${pkg:pretrain.recipes}`` is the shipped ``recipes``
folder (shipped data paths resolve from any directory). The pieces are merged in order,
then the recipe body, then ``key=value`` overrides (OmegaConf dotlist), and ``${...}`` interpolations are resolved.
``structured`` then builds the verb's dataclass: an unknown key names its path and the closest valid keys, a wrong
type names the expected type. Nothing is imported by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import math
import os
import re
import shlex
import types
import typing
import unicodedata
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.compat.omegaconf_nodes import child
from pretrain.errors import InputError


def shipped_dir(name: str) -> Path:
    """The folder of ``pretrain.<name>`` (``configs``, ``recipes``): inside the installed package (a wheel), else
    the repository's top-level folder that setuptools' ``package-dir`` maps there (a source checkout)."""
    package = Path(__file__).resolve().parents[1]
    return package / name if (package / name).is_dir() else package.parent / name


OVERRIDES_VARIABLE = "PRETRAIN_OVERRIDES"  # overrides appended to every recipe command's (e.g. a smoke run)
SHARED_DATA_VARIABLE = "PRETRAIN_SHARED_DATA"  # where the shipped pieces' data paths point
CONFIG_DIR = shipped_dir("configs")
RECIPE_DIR = shipped_dir("recipes")
TASK_DIR = CONFIG_DIR / "eval"  # evaluation tasks (``pretrain evaluate``, ``eval_during_fit``)
SHIPPED = {"pretrain.configs": CONFIG_DIR, "pretrain.recipes": RECIPE_DIR}


def _package_dir(name: str) -> str:
    """``${pkg:NAME}``: a shipped folder of ``SHIPPED`` or the directory of an installed package (located without
    importing it)."""
    if name in SHIPPED:
        return str(SHIPPED[name])
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"package {name!r} is not installed (needed by ${{pkg:{name}}}); pip install it")
    return str(Path(spec.submodule_search_locations[0]))


# OmegaConf (>= 2.4) refuses YAML of more than 10,000 nodes, a guard against alias bombs ("billion laughs") that
# also refuses a recipe listing 12,000 input files; its other guard, aliases expanding a document more than 100x,
# still applies. Real recipes have no aliases: the node limit only needs to bound memory.
YAML_NODE_LIMIT = 50_000_000
_YAML_LIMIT = (
    {"max_yaml_expanded_nodes": YAML_NODE_LIMIT}
    if "max_yaml_expanded_nodes" in inspect.signature(OmegaConf.load).parameters
    else {}
)


def load_yaml(path: str | Path, what: str = "recipe") -> Any:
    """``OmegaConf.load`` of a recipe, piece or task file (``what``) of any length: a YAML mapping of UTF-8 text."""
    try:
        loaded = OmegaConf.load(path, **_YAML_LIMIT)
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path} is not a YAML text file ({err.reason} at byte {err.start}: not UTF-8); a {what} is text"
        ) from None
    if not OmegaConf.is_dict(loaded):
        shape = "a list" if OmegaConf.is_list(loaded) else type(loaded).__name__
        raise InputError(f"{path}: a {what} is a YAML mapping (key: value lines), got {shape}")
    return loaded


if not OmegaConf.has_resolver("pkg"):
    OmegaConf.register_resolver("pkg", _package_dir)


def _piece_path(ref: str, recipe_dir: Path, config_dir: Path) -> Path:
    """``model/gpt-tiny`` -> ``<config_dir>/model/gpt-tiny.yaml`` (or a path relative to the recipe)."""
    name = ref if ref.endswith((".yaml", ".yml")) else ref + ".yaml"
    for base in (recipe_dir, config_dir):
        if (base / name).is_file():
            return base / name
    group = config_dir / Path(ref).parent
    known = sorted(p.stem for p in group.glob("*.yaml")) if group.is_dir() else []
    groups = sorted(p.name for p in config_dir.iterdir() if p.is_dir()) if config_dir.is_dir() else []
    raise FileNotFoundError(
        f"config piece {ref!r} not found in {config_dir} or {recipe_dir}"
        + (f"; pieces in {Path(ref).parent}/: {known}" if known else f"; groups: {groups}")
    )


def resolve_recipe(recipe: str | Path) -> Path:
    """A recipe file: ``recipe`` itself when it exists, else the shipped recipe of that name (``gpt-tiny``,
    ``gpt-tiny.yaml`` or ``recipes/gpt-tiny.yaml`` run from any directory, installed wheel included)."""
    path = Path(recipe)
    if path.is_file():
        return path
    if path.is_dir():
        raise InputError(
            f"recipe {recipe} is a directory; give a recipe YAML file in it, e.g. {path / 'gpt-tiny.yaml'}"
        )
    shipped = RECIPE_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if path.parent in (Path("."), Path("recipes")) and shipped.is_file():
        return shipped
    ready = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"recipe {recipe} not found; ready recipes (by name): {ready}")


def compose(
    recipe: str | Path, overrides: list[str] | None = None, config_dir: Path = CONFIG_DIR
) -> dict[str, Any]:
    """Merge the recipe's pieces (from ``config_dir``), its body and ``key=value`` overrides; return the resolved
    plain dict."""
    recipe = resolve_recipe(recipe)
    try:
        body = load_yaml(recipe)
        if not body:  # every key at its default is no recipe: a file emptied or cut short by mistake
            raise InputError(
                f"recipe {recipe} is empty; give a recipe with its keys (e.g. {RECIPE_DIR / 'gpt-tiny.yaml'})"
            )
        pieces = []
        for ref in body.pop("defaults", []) or []:
            group = Path(ref).parts[0]
            path = _piece_path(ref, recipe.parent, config_dir)
            if path.resolve() == recipe.resolve():
                raise InputError(
                    f"{recipe}: its defaults list the recipe itself ({ref!r}); remove it (defaults name config "
                    f"pieces, e.g. model/gpt-tiny)"
                )
            piece = load_yaml(path, "config piece")
            nested = "defaults" in piece
            if nested or Path(ref).is_absolute() or group == "..":
                raise InputError(
                    f"{recipe}: defaults entry {ref!r} "
                    + ("is a recipe (it has defaults of its own)" if nested else "is a path, not group/name")
                    + "; defaults name config pieces as group/name (model/gpt-tiny: configs/model/gpt-tiny.yaml, "
                    "placed under the key model); to build on a recipe, list its defaults and copy the keys "
                    "you keep"
                )
            pieces.append(OmegaConf.create({group: piece}))
        merged = OmegaConf.create({})
        for piece in [*pieces, body]:
            clash = _shape_clash(merged, piece)
            if clash:
                raise InputError(
                    f"cannot compose {recipe}: {clash} is a list in one place and a mapping in another; write it "
                    f"as the pieces do (data.sources is a YAML list: sources: [{{name: ..., text: [...]}}])"
                )
            merged = cast(DictConfig, OmegaConf.merge(merged, piece))  # mappings merge into a mapping
        return apply_overrides(merged, overrides)
    except (OmegaConfBaseException, TypeError) as err:
        raise InputError(f"cannot compose {recipe}: {one_line(err)}") from err
    except yaml.YAMLError as err:
        raise InputError(f"cannot compose {recipe}: {yaml_problem(err)}") from err


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: the file, line, column and problem."""
    mark = getattr(err, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"invalid YAML in {where}: {problem.split('. See ')[0]}"  # not the loader's advice to its caller


def one_line(err: BaseException) -> str:
    """An OmegaConf error as one line: its message and the key it names (not its multi-line report)."""
    text = (getattr(err, "msg", None) or str(err)).strip().splitlines()
    key = getattr(err, "full_key", None)
    return (f"{key}: " if key else "") + (text[0] if text else type(err).__name__)


def _shape_clash(base: Any, update: Any, prefix: str = "") -> str | None:
    """The first key that is a list in ``base`` and a mapping in ``update`` (or the reverse), if any."""
    if not (OmegaConf.is_dict(base) and OmegaConf.is_dict(update)):
        return None
    for key in update:
        if key not in base:
            continue
        a, b, path = child(base, key), child(update, key), f"{prefix}{key}"
        if (OmegaConf.is_list(a) and OmegaConf.is_dict(b)) or (OmegaConf.is_dict(a) and OmegaConf.is_list(b)):
            return path
        found = _shape_clash(a, b, f"{path}.")
        if found:
            return found
    return None


def _list_address(config: Any, key: str) -> str | None:
    """The problem when ``key`` walks into a list by a name instead of an index (``data.sources.name``)."""
    node, parts = config, key.split(".")
    for i, part in enumerate(parts[:-1] if len(parts) > 1 else []):
        node = (
            node.get(part)
            if OmegaConf.is_dict(node)
            else node[int(part)]
            if OmegaConf.is_list(node)
            else None
        )
        if node is None:
            return None
        nxt = parts[i + 1]
        if OmegaConf.is_list(node) and not nxt.lstrip("-").isdigit():
            head = ".".join(parts[: i + 1])
            return (
                f"{head} is a list; address an item by its index ({head}.0.{'.'.join(parts[i + 1 :])}=...) "
                f"or give the whole list ({head}=[...])"
            )
    return None


def apply_overrides(config: Any, overrides: list[str] | None) -> dict[str, Any]:
    """``key=value`` overrides (values parsed as in YAML: numbers, lists, null; ``a.b.0.c=`` addresses list
    items; ``~key`` deletes a key, e.g. ``~objective.options`` drops a piece's options) applied to a dict or
    OmegaConf node; returns the resolved plain dict."""
    merged = OmegaConf.create(config) if isinstance(config, dict) else config
    for item in overrides or []:
        if item.startswith("~") and "=" not in item:  # ~a.b deletes a.b (its schema default applies)
            parent, _, leaf = item[1:].rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if node is None or leaf not in node:
                raise InputError(f"override {item!r}: there is no {item[1:]!r} to delete")
            node.pop(leaf)
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"override {item!r} is not of the form key=value (e.g. trainer.max_steps=100)")
        problem = _list_address(merged, key)
        if problem:
            raise InputError(f"override {item!r}: {problem}")
        try:
            # ${...} stays an interpolation, resolved against the whole config below
            parsed = value if "${" in value else OmegaConf.from_dotlist([f"v={value}"]).v
            existing = OmegaConf.select(merged, key, default=None)
            if OmegaConf.is_list(existing) and (isinstance(parsed, dict) or OmegaConf.is_dict(parsed)):
                raise InputError(
                    f"override {item!r}: {key} is a list; give a list ({key}=[{{...}}]) or set one item's field "
                    f"({key}.0.FIELD=VALUE)"
                )
            OmegaConf.update(merged, key, parsed, merge=True)
        except OmegaConfBaseException as err:
            raise InputError(f"override {item!r}: {one_line(err)}") from err
        except yaml.YAMLError as err:  # the value's own YAML, not the recipe's
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise InputError(
                f"override {item!r}: the value is not valid YAML ({problem}); quote it to pass it as text "
                f"({key}='\"...\"') or complete it (lists [a, b], mappings {{k: v}})"
            ) from err
    try:
        return cast(dict[str, Any], OmegaConf.to_container(merged, resolve=True))  # a mapping's: a dict
    except OmegaConfBaseException as err:
        raise InputError(
            f"cannot resolve {one_line(err)} (an interpolation ${{a.b}} names a config key, e.g. ${{model.d_model}})"
        ) from err


def did_you_mean(given: str, choices: list[str], n: int = 1, cutoff: float = 0.6, quote: bool = False) -> str:
    """``; did you mean X?`` for the choices closest to ``given`` (or ``""``). A name holding characters that are
    not ASCII (a Cyrillic ``ѕ`` for ``s``, a zero-width space) looks like its suggestion: they are named."""
    close = [repr(c) if quote else c for c in difflib.get_close_matches(given, choices, n=n, cutoff=cutoff)]
    hint = f"did you mean {' / '.join(close)}?" if close else ""
    odd = [(i, c) for i, c in enumerate(given) if not c.isascii() or not c.isprintable()]
    if not odd:
        return f"; {hint}" if hint else ""
    chars = ", ".join(
        f"{c!r} (U+{ord(c):04X} {unicodedata.name(c, 'unnamed character')}) at position {i + 1}"
        for i, c in odd[:3]
    )
    return f"; {given!r} holds character(s) that only look like plain ones: {chars}; retype it" + (
        f" ({hint})" if hint else ""
    )


def shared_data() -> str | None:
    """The default ``data_root`` of task files: ``$PRETRAIN_SHARED_DATA``, else none (the recipe or
    ``--data-root`` names it; only the shipped config pieces fall back to a directory of their own)."""
    return os.environ.get(SHARED_DATA_VARIABLE)


def environment_overrides() -> list[str]:
    """The ``key=value`` overrides of ``$PRETRAIN_OVERRIDES`` (split as a shell splits words)."""
    text = os.environ.get(OVERRIDES_VARIABLE, "")
    try:
        return shlex.split(text)
    except ValueError as err:
        raise InputError(
            f"{OVERRIDES_VARIABLE}={text!r}: {str(err)[:1].lower()}{str(err)[1:]}; it is split into key=value words "
            "as a shell splits them: close the quote (or escape it with a backslash)"
        ) from None


def blame_environment(err: InputError, from_environment: list[str]) -> InputError:
    """``err`` naming where an override of ``$PRETRAIN_OVERRIDES`` it is about came from (else ``err``)."""
    text = str(err)
    for item in from_environment:
        key = item.lstrip("~").partition("=")[0]
        if item in text or (key and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text)):
            return InputError(
                f"{text} (from {OVERRIDES_VARIABLE}={os.environ.get(OVERRIDES_VARIABLE, '')!r})"
            )
    return err


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_type(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` converted to ``tp`` (dataclasses built recursively); ``ValueError`` naming ``path`` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message (e.g. the choices of a Literal)
            return check_type(value, options[0], path)
        for arg in options:
            try:
                return check_type(value, arg, path)
            except InputError:
                continue
        raise InputError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if value is None and tp is not Any and not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        raise InputError(
            f"{path}: needs a value ({_type_name(tp) if origin is not Literal else list(args)}), got none (an "
            f"empty override `{path}=` or null); give one, or drop the override to keep the recipe's"
        )
    if origin is Literal:
        if value in args or (isinstance(value, int) and str(value) in args):
            return value if value in args else str(value)
        hint = did_you_mean(str(value), [str(a) for a in args], quote=True)
        raise InputError(f"{path}: {value!r} is not one of {list(args)}{hint}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return structured(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{path}: expected a list, got {value!r}")
        return [check_type(v, args[0] if args else Any, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"{path}: expected a mapping, got {value!r}")
        return {k: check_type(v, args[1] if args else Any, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):  # every comparison with nan is false: no bound check would catch it
                raise InputError(f"{path}: expected a number, got nan")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML reads an unquoted `32` as a number
        if isinstance(value, bool):  # `resume=yes`: YAML 1.1's yes/no/on/off/true/false are booleans
            forms = {"resume": "; resume is auto, null or a checkpoint path"}.get(path, "")
            raise InputError(
                f"{path}: expected text, got the boolean {value} (YAML reads an unquoted yes, no, on, off, true or "
                f"false as one; quote text: {path}=\"'{'yes' if value else 'no'}'\"){forms}"
            )
    else:
        raise TypeError(f"{path}: unsupported schema type {tp!r}")
    raise InputError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def check_counts(**values: int) -> None:
    """ValueError unless every value is an integer >= 1 (window, negatives, min_count, ...)."""
    meaning = {"window": " (context words on each side)", "negatives": " (k noise words per example)"}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name}{meaning.get(name, '')} must be an integer >= 1, got {value!r}")


def check_run_name(name: str) -> None:
    """A run name is one path component (it names ``runs/<name>``); ``run_dir`` places a run anywhere."""
    if not name or name in (".", "..") or any(c in name for c in "/\\") or not name.isprintable():
        raise InputError(
            f"name {name!r} must be a plain run name (no '/', '\\', '..' or control characters such as a line "
            f"break: it names the directory runs/<name>); to write the run elsewhere set run_dir=PATH"
        )


def _section_word_hint(cls: type, node: Any, path: str) -> str:
    """What ``objective=prefix_lm`` / ``strategy=fsdp`` / ``lora=r8`` (a section set to a word, as other tools pick a
    config group) was likely meant as: the config piece of that name (chosen in a recipe's ``defaults``), and the
    section's ``name`` key."""
    if not isinstance(node, str) or not path or "." in path or not re.fullmatch(r"[\w.-]+", node):
        return ""
    hints = []
    for base in (CONFIG_DIR, CONFIG_DIR / "finetune"):
        if (base / path / f"{node}.yaml").is_file():
            hints.append(
                f"the config piece {path}/{node} ({base / path / node}.yaml) is chosen in a recipe's defaults "
                f"list (defaults: [..., {path}/{node}]), not by a {path}={node} override"
            )
            break
    if "name" in {f.name for f in dataclasses.fields(cls)}:
        hints.append(f"to set the section's name: {path}.name={node}")
    return "".join(f"; {h}" for h in hints)


def structured(cls: type, node: Any, path: str = "") -> Any:
    """Dataclass ``cls`` from a plain dict, every key and type checked (see the module docstring)."""
    if not isinstance(node, dict):
        keys = ", ".join(sorted(f.name for f in dataclasses.fields(cls))[:4])
        raise InputError(
            f"{path or 'config'}: expected a section of key: value settings ({keys}, ...), got {node!r}"
            + _section_word_hint(cls, node, path)
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in node:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            hint = did_you_mean(str(key), sorted(fields), n=3, cutoff=0.5)
            raise InputError(
                f"unknown config key {key!r} at {where}{hint} (valid keys of {path or 'the run'}: {sorted(fields)})"
            )
    kwargs = {k: check_type(v, hints[k], f"{path}.{k}" if path else k) for k, v in node.items()}
    try:
        return cls(**kwargs)
    except (TypeError, InputError) as err:  # the dataclass's own checks name its fields as ``Class.field``
        text = str(err)
        named = path and f"{cls.__name__}." in text
        raise InputError(
            text.replace(f"{cls.__name__}.", f"{path}.") if named else f"{path or 'config'}: {text}"
        ) from err


def resolve_task_file(name: str) -> Path:
    """A task file path, or ``configs/eval/<name>.yaml``; the error lists the known names."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = TASK_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"unknown task {name!r}: not a task file, and not one of {known} (configs/eval/)")
