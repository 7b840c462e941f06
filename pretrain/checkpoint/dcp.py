"""torch.distributed.checkpoint (DCP) directories read without running code from them, whole or by keys.

DCP's own reader unpickles ``.metadata`` and every non-tensor item with plain pickle; here the metadata is
read by an unpickler that admits DCP's metadata classes only, and items with ``torch.load(weights_only=True)``
(tensors are read that way by DCP already). Keys are DCP's flattened names (``state_dict.model.embed.tok.weight``,
``optimizer_0.state.<param>.exp_avg``, ``optimizer_0.param_groups.0.lr``); ``Metadata.planner_data`` maps each
to its path in the nested state dict.
"""

from __future__ import annotations

import itertools
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from pretrain.errors import InputError

# DCP's note, on every call with no_dist=True, that it assumes this process is alone (as intended here)
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

# what DCP's .metadata pickles: its own classes, torch.Size and dtypes, a layout, paths
_SAFE_MODULES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith(_SAFE_MODULES)
            or (module, name) in _SAFE_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never holds; not loaded"
            )
        return super().find_class(module, name)


class WeightsOnlyReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with DCP's metadata classes admitted only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise InputError(f"checkpoint {path.parent} has unreadable DCP metadata ({err})") from err
        if not isinstance(metadata, Metadata):
            raise InputError(f"{path} is not DCP metadata")
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` over a flat state dict (``flatten_state_dict=False``) reading non-tensor items
    (optimizer hyper-parameters) with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def rank_errors(err: BaseException) -> list[BaseException]:
    """The ranks' errors a DCP ``CheckpointException`` (a ``BaseException``) holds, its failures being (error,
    traceback) by rank; [] for any other exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException):
        return []
    failures = [e[0] if isinstance(e, tuple) else e for e in err.failures.values()]
    return [e for e in failures if isinstance(e, BaseException)]


@contextmanager
def readable(path: str | Path) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException`` holding each rank's error) as one ``ValueError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        causes = rank_errors(err)
        if any(isinstance(e, pickle.UnpicklingError) for e in causes):
            raise InputError(
                f"checkpoint {path} holds objects other than tensors and plain containers, which a weights-only "
                "load refuses; it was not written by `pretrain fit` (or was altered) and is not loaded"
            ) from err
        first = str(causes[0]).strip().splitlines()[0] if causes else str(err)
        raise InputError(f"checkpoint {path} could not be read: {first}") from err


def metadata(path: str | Path) -> Metadata:
    return WeightsOnlyReader(path).read_metadata()


Path_ = tuple[str | int, ...]


def flatten(nested: Any, prefix: Path_ = ()) -> dict[str, Path_]:
    """DCP's flattened key (``a.b.0.c``) of every leaf of ``nested``, with its path, by DCP's rule
    (``torch.distributed.checkpoint._traverse``): a dict is entered, a list only when it holds a tensor, a
    dict or such a list; anything else (a tuple too) is one value."""
    if isinstance(nested, dict):
        out: dict[str, Path_] = {}
        for key, value in nested.items():
            out.update(flatten(value, (*prefix, key)))
        return out
    if isinstance(nested, list) and not _terminal(nested):
        out = {}
        for i, value in enumerate(nested):
            out.update(flatten(value, (*prefix, i)))
        return out
    return {".".join(map(str, prefix)): prefix}


def _terminal(value: Any) -> bool:
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or not _terminal(v) for v in value)


def get_path(nested: Any, path: Path_) -> Any:
    for part in path:
        nested = nested[part]
    return nested


def set_path(nested: Any, path: Path_, value: Any) -> None:
    node: Any = nested
    for part, following in itertools.pairwise(path):
        if isinstance(node, list):
            assert isinstance(part, int)  # a list's key is its index
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = [] if isinstance(following, int) else {}
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(following, int) else {})
    if isinstance(node, list):
        assert isinstance(path[-1], int)
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def load(
    state_dict: dict[str, Any], path: str | Path, *, process_group: Any = None, no_dist: bool = True
) -> None:
    """``torch.distributed.checkpoint.load`` into ``state_dict`` (nested; its tensors and DTensors filled in
    place, resharded to their layout; other leaves replaced) from ``path``, weights only."""
    import torch.distributed.checkpoint as dcp

    paths = flatten(state_dict)
    flat = {key: get_path(state_dict, p) for key, p in paths.items()}
    with readable(path):
        dcp.load(
            flat,
            storage_reader=WeightsOnlyReader(path),
            planner=WeightsOnlyLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    for key, p in paths.items():
        if not isinstance(flat[key], torch.Tensor):
            set_path(state_dict, p, flat[key])


def read_flat(
    path: str | Path, keys: Iterable[str] | None = None, md: Metadata | None = None
) -> dict[str, Any]:
    """``{flattened key: value}`` of ``keys`` (default: all), every tensor whole, in this process."""
    import torch.distributed.checkpoint as dcp

    md = md or metadata(path)
    wanted = list(md.state_dict_metadata) if keys is None else list(keys)
    flat: dict[str, Any] = {}
    for key in wanted:
        item = md.state_dict_metadata[key]
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # replaced by the loaded object
    with readable(path):
        dcp.load(flat, storage_reader=WeightsOnlyReader(path), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return flat


def unflatten(flat: dict[str, Any], md: Metadata) -> dict[str, Any]:
    """The nested state dict of ``flat`` values, by ``md.planner_data``'s paths."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        set_path(nested, md.planner_data[key] if md.planner_data else (key,), value)
    return nested


def read(path: str | Path, select: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The nested state dict of a DCP directory (of the keys ``select`` admits), every tensor whole."""
    md = metadata(path)
    keys = [k for k in md.state_dict_metadata if select is None or select(k)]
    return unflatten(read_flat(path, keys, md), md)
