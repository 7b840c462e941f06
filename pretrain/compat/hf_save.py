"""A transformers model directory's weights written one tensor at a time (``pretrain export``, ``pretrain convert
--to hf``): the files ``save_pretrained`` writes, byte for byte, without the model's weights in memory.

``saved_keys``: the state-dict keys ``save_pretrained`` writes for a model (transformers 5.24's
``remove_tied_weights_from_state_dict``: a tied weight once, under the name the model reloads; the model may be
on the meta device). ``ValueError`` when the model's weight conversions would rename keys on save (its
``revert_weight_conversion`` is not the identity): only a whole state dict can be converted.

``write_weights``: the weight files ``save_pretrained`` writes, one or sharded (huggingface_hub's split, the
index transformers writes), each through ``write_safetensors``.

``write_safetensors``: the bytes ``safetensors.torch.save_file`` (safetensors 0.8) writes for tensors given as
their shapes and dtypes, each tensor's data asked for when the writer reaches it and dropped once written. The
format: the header's length N (8 bytes, little-endian), N bytes of compact JSON (``__metadata__``, then each
tensor's ``dtype``, ``shape`` and ``data_offsets``) padded with spaces to a multiple of 8, then the tensors' bytes
back to back. The library's Rust serializer orders the tensors by dtype, then name; rather than restate that
rule, the order (and the header's dtype names and key order) is the library's own for one-element stand-ins of
the same names and dtypes, into which the real shapes and offsets are written. Tested against ``save_file``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_CHUNK = 16 << 20  # bytes of a (transposed) tensor made contiguous at a time


def saved_keys(hf_model: Any) -> list[str]:
    """The keys of ``hf_model.state_dict()`` that ``save_pretrained`` writes, in state-dict order."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(dict(hf_model.state_dict()), hf_model)
    if sorted(revert_weight_conversion(hf_model, dict(kept))) != sorted(kept):
        raise ValueError(f"{type(hf_model).__name__} renames its weights on save; it is saved whole")
    return list(kept)


def write_weights(
    directory: str | Path,
    hf_model: Any,
    keys: list[str],
    produce: Callable[[str], torch.Tensor],
    max_shard_size: int,
) -> None:
    """The weight files ``hf_model.save_pretrained(directory, max_shard_size=...)`` writes for its tensors ``keys``
    (:func:`saved_keys`; ``hf_model`` may be on the meta device: only shapes and dtypes are read), each tensor's data
    from ``produce(key)``: ``model.safetensors``, or above ``max_shard_size`` bytes the shards huggingface_hub's
    ``split_torch_state_dict_into_shards`` assigns and ``model.safetensors.index.json`` (transformers 5.24: its
    ``total_parameters``, the split's ``total_size``, the weight map; sorted keys, indent 2, a final newline)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    directory = Path(directory)
    state = hf_model.state_dict()
    saved = {k: state[k] for k in keys}
    split = split_torch_state_dict_into_shards(
        saved, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for file, names in split.filename_to_tensors.items():
        specs = {k: (saved[k].shape, saved[k].dtype) for k in names}
        write_safetensors(directory / file, specs, produce, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": hf_model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / "model.safetensors.index.json").write_text(text, encoding="utf-8")


def _layout(
    specs: dict[str, tuple[torch.Size, torch.dtype]], metadata: dict[str, str] | None
) -> tuple[bytes, list[str]]:
    """(the file's header: length, JSON, padding; the tensors' names in the order their bytes follow)."""
    from safetensors.torch import save

    probe = save({name: torch.zeros(1, dtype=dtype) for name, (_, dtype) in specs.items()}, metadata=metadata)
    (length,) = struct.unpack("<Q", probe[:8])
    entries = json.loads(probe[8 : 8 + length])
    order = sorted((k for k in entries if k != "__metadata__"), key=lambda k: entries[k]["data_offsets"][0])
    at, offsets = 0, {}
    for name in order:
        shape, dtype = specs[name]
        end = at + shape.numel() * dtype.itemsize
        offsets[name] = [at, end]
        at = end
    header = {
        k: v
        if k == "__metadata__"
        else {"dtype": v["dtype"], "shape": list(specs[k][0]), "data_offsets": offsets[k]}
        for k, v in entries.items()
    }
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(
    path: str | Path,
    specs: dict[str, tuple[torch.Size, torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> Path:
    """``safetensors.torch.save_file({name: produce(name)}, path, metadata)``'s bytes, ``specs`` giving each tensor's
    shape and dtype; ``produce(name)`` (any strides) is called once per tensor, in the file's order, and its result
    dropped once written (a transposed tensor made contiguous 16 MiB at a time)."""
    path = Path(path)
    header, order = _layout(specs, metadata)
    with open(path, "wb") as f:
        f.write(header)
        for name in order:
            tensor = produce(name)
            if (tensor.shape, tensor.dtype) != specs[name]:
                raise ValueError(
                    f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected "
                    f"{tuple(specs[name][0])} {specs[name][1]}"
                )
            _write_tensor(f, tensor)
            del tensor
    return path


def _write_tensor(f: Any, tensor: torch.Tensor) -> None:
    """``tensor``'s bytes in row-major order: a contiguous tensor's memory itself, another's rows copied 16 MiB at
    a time into a buffer mapped for it (``memory.unpooled``; malloc's heap kept such blocks)."""
    from pretrain.memory import unpooled

    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if not tensor.numel():
        return
    if tensor.is_contiguous():
        f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        return
    row = tensor[0].numel()
    step = max(1, _CHUNK // max(1, row * tensor.element_size()))
    buffer = unpooled(torch.Size([min(step, tensor.shape[0]) * row]), tensor.dtype)
    for at in range(0, tensor.shape[0], step):
        rows = tensor[at : at + step]
        chunk = buffer[: rows.numel()].view(rows.shape).copy_(rows)
        f.write(chunk.reshape(-1).view(torch.uint8).numpy().data)
