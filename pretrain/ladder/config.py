"""The recipe's ``ladder:`` section: which model sizes and token budgets a scaling-law ladder trains.

    ladder:
      sizes: [{d_model: 64, n_layer: 2}, {d_model: 96, n_layer: 3}, {d_model: 128, n_layer: 4}]
      flops: [3.0e11, 1.0e12, 3.0e12]   # or tokens_per_param: [5, 10, 20]
      head_dim: 32                        # n_head = d_model / head_dim

Every size trains at every budget (one ``pretrain fit`` run per cell). A FLOP budget C gives a size
D = C / F tokens (F: training FLOPs per token, ``Transformer.flops_per_token``, MFU's convention); a
tokens-per-parameter budget r gives D = r N (N: non-embedding parameters). The rest of the recipe (objective,
data, optimizer, muP) is every cell's, so one learning rate serves all widths (``model.parametrization: mup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pretrain.config.compose import structured
from pretrain.errors import InputError


@dataclass
class SizeConfig:
    """One model size: width and depth (``n_decoder_layer``: an encoder-decoder's decoder, default n_layer)."""

    d_model: int
    n_layer: int
    n_decoder_layer: int | None = None


@dataclass
class LadderConfig:
    sizes: list[SizeConfig] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)  # training FLOPs per cell (isoFLOP profiles)
    tokens_per_param: list[float] = field(default_factory=list)  # D / N per cell
    head_dim: int | None = None  # default: the recipe's model.head_dim (n_head = d_model / head_dim)
    d_ff_ratio: float | None = None  # d_ff / d_model; default: the recipe's
    held_out: Literal["largest", "none"] = "largest"  # the largest-compute cell is predicted, not fitted
    min_steps: int = 50  # a cell with fewer optimizer steps is refused (the schedule would be mostly warm-up)
    val_batches: int | None = None  # batches of the final validation; None: the whole validation split
    checkpoints_per_cell: int = 4  # a killed cell resumes from the last of these
    bootstrap: int = 200  # resamples for the 95 % intervals
    seed: int = 0  # the bootstrap's
    group: str | None = None  # W&B group of the cells; default: ladder-<out dir name>

    @property
    def budget_kind(self) -> Literal["flops", "tokens_per_param"]:
        return "flops" if self.flops else "tokens_per_param"

    @property
    def budgets(self) -> list[float]:
        return list(self.flops or self.tokens_per_param)


def ladder_config(raw: Any) -> LadderConfig:
    """The typed ``ladder`` section; ValueError (one line, naming the ``ladder.`` key) on bad input."""
    if raw is None:
        raise InputError(
            "the recipe has no `ladder:` section; add one with ladder.sizes and ladder.flops or "
            "ladder.tokens_per_param (see recipes/ladder-tiny.yaml)"
        )
    ladder = structured(LadderConfig, raw, "ladder")
    if not ladder.sizes:
        raise InputError("ladder.sizes is empty; list the model sizes, e.g. [{d_model: 64, n_layer: 2}, ...]")
    if bool(ladder.flops) == bool(ladder.tokens_per_param):
        raise InputError(
            "give the token budgets as exactly one of ladder.flops (FLOPs per cell) or ladder.tokens_per_param"
        )
    if any(not b > 0 for b in ladder.budgets):
        raise InputError(f"ladder.{ladder.budget_kind} must all be > 0, got {ladder.budgets}")
    if len(set(ladder.budgets)) != len(ladder.budgets):
        raise InputError(f"ladder.{ladder.budget_kind} lists a budget twice: {ladder.budgets}")
    shapes = [(s.d_model, s.n_layer, s.n_decoder_layer) for s in ladder.sizes]
    if len(set(shapes)) != len(shapes):
        raise InputError(f"ladder.sizes lists a size twice: {shapes}")
    for i, s in enumerate(ladder.sizes):
        if min(s.d_model, s.n_layer, s.n_decoder_layer or 1) < 1:
            raise InputError(f"ladder.sizes[{i}]: d_model and n_layer must be >= 1, got {s}")
    for name in ("min_steps", "checkpoints_per_cell", "bootstrap", "val_batches"):
        if (getattr(ladder, name) or 1) < 1:
            raise InputError(f"ladder.{name} must be >= 1, got {getattr(ladder, name)}")
    return ladder
