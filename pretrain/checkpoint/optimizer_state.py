"""Optimizer state in the two layouts a checkpoint holds it in: by position (``torch.optim.Optimizer.state_dict``,
what a single-process run's file holds) and by parameter name (``torch.distributed.checkpoint.state_dict``, what a
DCP directory holds); and a Lightning checkpoint's tensors in the DCP layout."""

from __future__ import annotations

from typing import Any

import torch


def optimizer_state_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``torch.distributed.checkpoint.state_dict``'s layout: ``state`` by parameter
    name, groups listing names) in ``torch.optim.Optimizer.state_dict``'s layout: parameters numbered in the
    order the groups list them."""
    numbers: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [numbers.setdefault(n, len(numbers)) for n in group["params"]]})
    return {"state": {numbers[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_by_position` for ``optimizer`` over ``model``'s parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    return optimizer_state_by_names(
        state, [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    )


def optimizer_state_by_names(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """A state by position (``torch.optim.Optimizer.state_dict``) keyed by the parameter names of its groups,
    in order (``group_names``: the names of each group's parameters)."""
    by_number: dict[int, str] = {}
    groups = []
    for saved, names in zip(state["param_groups"], group_names, strict=True):
        by_number.update(zip(saved["params"], names, strict=True))
        groups.append({**saved, "params": [by_number[i] for i in saved["params"]]})
    return {"state": {by_number[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def is_name_keyed(state: dict[str, Any]) -> bool:
    """Whether an optimizer state lists its parameters by name (DCP's layout) rather than by position."""
    return any(isinstance(n, str) for g in state.get("param_groups", []) for n in g["params"])


def dcp_state(
    checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer], module: torch.nn.Module
) -> dict[str, Any]:
    """The tensors of a Lightning checkpoint in the layout of an FSDP sharded checkpoint, popped out of it:
    ``state_dict`` and ``optimizer_<i>`` keyed by parameter name (``module``'s names for ``optimizers``' state
    listed by position), and the weights' moving average (``ema``: FSDP2's are DTensors, saved as shards). What
    stays in ``checkpoint`` is its ``meta.pt``."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, (optimizer, state) in enumerate(
        zip(optimizers, checkpoint.pop("optimizer_states", []), strict=True)
    ):
        tensors[f"optimizer_{i}"] = (
            state if is_name_keyed(state) else optimizer_state_by_name(state, optimizer, module)
        )
    if "ema" in checkpoint:
        tensors["ema"] = checkpoint.pop("ema")
    return tensors


def optimizer_count(state: dict[str, Any]) -> int:
    """How many ``optimizer_<i>`` entries a DCP state dict holds."""
    return sum(1 for k in state if k.startswith("optimizer_"))
