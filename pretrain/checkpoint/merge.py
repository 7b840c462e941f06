"""Weighted checkpoint averaging (``pretrain merge``): ``theta = sum_i w_i theta_i`` over the weights of checkpoints of
one model -- of any layout (a file, a DCP directory, a DeepSpeed directory) -- accumulated in float32 in the
order given, tensor by tensor (one parameter of every input in memory at a time), written as one checkpoint file
that ``validate``, ``export``, ``evaluate`` and ``generate`` read (the weights and the Lightning state of the last
input, no optimizer state: it is a model, not a run to resume). The weights must sum to 1 (a merge is an
average; they are not rescaled). As in the checkpoint averaging of the WSD schedule's constant phase (MiniCPM,
Hu et al. 2024; Megatron's weighted merging; OLMo-core's merge callback).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.io import PAYLOAD, kind, lightning_state, read, write_atomically
from pretrain.checkpoint.stream import open_source
from pretrain.compat.torch_save import placeholders, save_filled
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig

DROPPED = ("optimizer_states", "lr_schedulers", "ema", "ema_partitions")  # a merge is weights only


def parse_weights(text: str) -> list[float]:
    """``--weights 0.25,0.75`` -> ``[0.25, 0.75]``."""
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise InputError(
            f"--weights {text}: give numbers separated by commas (e.g. --weights 0.25,0.75)"
        ) from None


def check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """The merge's coefficients: ``weights`` (one per checkpoint, summing to 1), or ``1/n`` each."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise InputError(
            f"--weights gives {len(weights)} weights for {n} checkpoints; give one per checkpoint"
        )
    if not all(math.isfinite(w) for w in weights):
        raise InputError(f"--weights {','.join(map(str, weights))}: every weight must be a finite number")
    total = math.fsum(weights)
    if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-6):
        # the weights rescaled to sum to 1, where they can be (a sum of 0 cannot: then the uniform ones)
        example = [w / total for w in weights] if total != 0 else [1.0 / n] * n
        raise InputError(
            f"--weights sum to {total:g}, not 1; a merge is a weighted average and the weights are not rescaled: "
            f"give weights that sum to 1 (e.g. {','.join(f'{w:.6g}' for w in example)})"
        )
    return list(weights)


def check_mergeable(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The payloads of ``paths``, which must hold the same model (``ModelConfig.identity``) and tokenizer."""
    if len(paths) < 2:
        raise InputError("merge needs at least 2 checkpoints")
    states = []
    for path in paths:
        state = lightning_state(path)
        if PAYLOAD not in state:
            raise InputError(f"{path} is not a checkpoint written by `pretrain fit` (no {PAYLOAD!r} section)")
        states.append(state[PAYLOAD])
    first = states[0]
    for path, state in zip(paths[1:], states[1:], strict=True):
        kinds = ["`pretrain finetune`" if "finetune" in s else "`pretrain fit`" for s in (first, state)]
        if (
            kinds[0] != kinds[1]
        ):  # a task model (head, adapters) and a language model: other weights, tokenizers
            raise InputError(
                f"cannot merge {paths[0]} and {path}: a {kinds[0]} checkpoint and a {kinds[1]} one; merge "
                "checkpoints of one kind (of one run, or of runs of one recipe)"
            )
        a = ModelConfig.identity(first["config"]["model"])
        b = ModelConfig.identity(state["config"]["model"])
        diffs = [f"model.{k}: {a[k]!r} vs {b[k]!r}" for k in sorted(a) if a[k] != b.get(k)]
        if diffs:
            raise InputError(
                f"cannot merge {paths[0]} and {path}: different models ({', '.join(diffs)}); merge checkpoints of one "
                "model (the same run, or runs of one recipe)"
            )
        if first.get("tokenizer_json") != state.get("tokenizer_json"):
            raise InputError(
                f"cannot merge {paths[0]} and {path}: trained with different tokenizers (their token ids mean other "
                "things); merge checkpoints trained with one tokenizer"
            )
    return states


class _Weights(contextlib.ExitStack):
    """One checkpoint's ``state_dict`` tensor by tensor: a file memory-mapped, a directory streamed."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        if kind(path) == "file":
            self.tensors = read(path, mmap=True)["state_dict"]
            self.load = self.tensors.__getitem__
        else:
            source = self.enter_context(open_source(path, work_dir=tempfile.gettempdir()))
            self.tensors = source.tensors["state_dict"]

            def load(name: str) -> torch.Tensor:
                key = f"state_dict.{name}"
                return source.load(key) if key in source.loadable else self.tensors[name]

            self.load = load


def merge(paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None) -> Path:
    """Write ``sum_i weights[i] * state_dict_i`` (float32 accumulation, in order) of ``paths`` to ``out``."""
    files = [Path(p) for p in paths]
    coefficients = check_weights(weights, len(files))
    out = Path(out)
    if out.exists():  # an input, or a run's last.ckpt: a merge is weights only, the run's state would be lost
        raise InputError(f"--out {out} exists; merge into a new path (nothing is overwritten)")
    check_mergeable(files)
    with contextlib.ExitStack() as stack:
        inputs = [stack.enter_context(_Weights(p)) for p in files]
        names = list(inputs[0].tensors)
        for source in inputs[1:]:
            if list(source.tensors) != names:
                missing = sorted(set(names) ^ set(source.tensors))
                raise InputError(
                    f"cannot merge {files[0]} and {source.path}: their weights differ ({missing[:3]})"
                )
        make = stack.enter_context(placeholders())
        merged = {name: make(inputs[0].tensors[name].shape, inputs[0].tensors[name].dtype) for name in names}
        by_storage = {t.untyped_storage().data_ptr(): n for n, t in merged.items() if t.numel()}

        def fill(storage: torch.UntypedStorage) -> torch.Tensor | None:
            name = by_storage.get(storage.data_ptr())
            if name is None:
                return None
            return average((source.load(name) for source in inputs), coefficients).to(merged[name].dtype)

        checkpoint = {
            k: v for k, v in lightning_state(files[-1]).items() if k not in DROPPED and k != "state_dict"
        }
        checkpoint["state_dict"] = merged
        checkpoint[PAYLOAD] = {
            **checkpoint[PAYLOAD],
            "merged_from": [str(p) for p in files],
            "merge_weights": coefficients,
        }
        write_atomically(out, lambda f: save_filled(checkpoint, f, fill))
    return out


def average(tensors: Iterable[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i weights[i] * tensors[i]`` in float32, accumulated in order (each tensor read when it is added)."""
    total: torch.Tensor | None = None
    for tensor, weight in zip(tensors, weights, strict=True):
        term = weight * tensor.float()
        total = term if total is None else total.add_(term)
    assert total is not None
    return total
