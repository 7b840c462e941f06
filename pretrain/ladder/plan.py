"""A ladder's cells: every (size, budget) pair as an ordinary ``pretrain fit`` recipe under ``DIR/runs/<cell>``.

Per cell: N = non-embedding parameters (every parameter but the token, position and segment tables and the
LM head's vocabulary projection, tied or not: what grows with width and depth, not with the vocabulary),
F = training FLOPs per token by MFU's convention (``Transformer.flops_per_token``: 6 x every matmul weight
incl. the LM head + 12 L d T attention, forward + backward, LM head at every position), D = optimizer steps x
tokens per step (model input tokens, as ``train/tokens_seen``) and C = D F. The cell's recipe is the ladder
recipe resolved (its ``ladder:`` section dropped) with the size's shape, ``trainer.max_steps``, one
validation over the whole validation split at the end, ``checkpoint.every_n_steps`` (so a killed cell resumes),
its run directory and the ladder's W&B group.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import RunConfig, compose, validate
from pretrain.errors import InputError
from pretrain.ladder.config import LadderConfig, SizeConfig, ladder_config

PLAN_FILE = "plan.json"
RECIPE_FILE = "recipe.yaml"
N_DEFINITION = "non-embedding parameters: all but the token/position/segment tables and the LM head's vocabulary projection"
FLOPS_CONVENTION = (
    "C = D x F, F = Transformer.flops_per_token (MFU's: 6 x matmul weights incl. the LM head at every position "
    "+ 12 L d T attention, forward + backward); D = steps x tokens per step (model input tokens)"
)


@dataclass(frozen=True)
class Shape:
    """A model shape of the ladder (``model.*`` overrides)."""

    d_model: int
    n_layer: int
    n_decoder_layer: int | None
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int

    def overrides(self) -> dict[str, int]:
        out = {"d_model": self.d_model, "n_layer": self.n_layer, "n_head": self.n_head}
        out |= {"n_kv_head": self.n_kv_head, "head_dim": self.head_dim, "d_ff": self.d_ff}
        if self.n_decoder_layer is not None:
            out["n_decoder_layer"] = self.n_decoder_layer
        return out


@dataclass
class Cell:
    name: str
    shape: Shape
    budget: float  # FLOPs or tokens per parameter, as in the ladder section
    params: int  # N, non-embedding
    flops_per_token: float  # F
    steps: int
    tokens: int  # D
    flops: float  # C = D F
    run_dir: str
    recipe: str
    held_out: bool = False

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


@dataclass
class Plan:
    recipe: str
    overrides: list[str]
    cwd: str  # the cells run from here (the recipe's relative paths)
    objective: str
    arch: str
    budget_kind: str
    group: str
    tokens_per_step: int
    seq_len: int
    decoder_len: int | None
    cells: list[Cell] = field(default_factory=list)
    ladder: dict[str, Any] = field(default_factory=dict)

    @property
    def fitted(self) -> list[Cell]:
        return [c for c in self.cells if not c.held_out]

    def cell(self, name: str) -> Cell:
        return next(c for c in self.cells if c.name == name)

    def to_json(self) -> str:
        body = asdict(self)
        body["n_definition"], body["flops_convention"] = N_DEFINITION, FLOPS_CONVENTION
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        body = json.loads(text)
        for key in ("n_definition", "flops_convention"):
            body.pop(key, None)
        cells = [Cell(**{**c, "shape": Shape(**c["shape"])}) for c in body.pop("cells")]
        return cls(**body, cells=cells)


def load_ladder(recipe: str | Path, overrides: list[str]) -> tuple[LadderConfig, dict[str, Any], RunConfig]:
    """The recipe's ``ladder`` section, the rest of it (resolved), and that rest validated as a run."""
    raw = compose(recipe, overrides)
    ladder = ladder_config(raw.pop("ladder", None))  # the cells are runs without it
    if raw.get("model", {}).get("parametrization") != "mup":
        raise InputError(
            "a ladder trains every width with one learning rate, which needs muP: set model.parametrization=mup "
            "(and model.mup_base_width to the width the learning rate was tuned at)"
        )
    return ladder, raw, validate(copy.deepcopy(raw))


def shape_of(size: SizeConfig, run: RunConfig, ladder: LadderConfig) -> Shape:
    """The size's full shape: heads of ``ladder.head_dim`` (default the recipe's), d_ff at the recipe's ratio."""
    m = run.model
    head_dim = ladder.head_dim or m.head_dim or m.d_model // m.n_head
    ratio = ladder.d_ff_ratio or (m.d_ff or 4 * m.d_model) / m.d_model
    if size.d_model % head_dim:
        raise InputError(
            f"ladder.sizes: d_model={size.d_model} is not a multiple of the head dimension {head_dim}; pick widths "
            f"divisible by it or set ladder.head_dim"
        )
    decoder = None
    if m.arch == "encoder-decoder":
        decoder = size.n_decoder_layer or size.n_layer
    elif size.n_decoder_layer is not None:
        raise InputError(f"ladder.sizes: n_decoder_layer is for encoder-decoders; model.arch is {m.arch}")
    d_ff = max(1, round(ratio * size.d_model))
    n_head = size.d_model // head_dim
    group = m.n_head // (m.n_kv_head or m.n_head)  # query heads per key/value head, as in the recipe
    if n_head % group:
        raise InputError(
            f"ladder.sizes: d_model={size.d_model} gives {n_head} heads, not a multiple of the recipe's {group} query "
            f"heads per key/value head (model.n_head / model.n_kv_head)"
        )
    return Shape(size.d_model, size.n_layer, decoder, n_head, n_head // group, head_dim, d_ff)


def measure(run: RunConfig, shape: Shape, seq_len: int, decoder_len: int | None) -> tuple[int, float]:
    """(N, F) of ``run``'s model at ``shape``: non-embedding parameters, training FLOPs per input token."""
    import dataclasses

    import torch

    from pretrain.models.transformer import Transformer

    changes: dict[str, Any] = shape.overrides()
    config = dataclasses.replace(run.model, **changes)
    with torch.device("meta"):
        model = Transformer(config)
    params = model.num_params(exclude_embeddings=True)
    if model.lm_head is not None and not config.tie_embeddings:
        params -= model.lm_head.weight.numel()  # the vocabulary projection (its bias, if any, stays)
    return params, model.flops_per_token(seq_len, decoder_len)


def decoder_length(run: RunConfig) -> int | None:
    """The decoder input length the objective makes from a ``data.seq_len`` input (encoder-decoders), else None."""
    if run.model.arch != "encoder-decoder":
        return None
    import torch

    from pretrain.datamodules.tokenizer import load_tokenizer
    from pretrain.training.setup import build_objective

    tokenizer = load_tokenizer(run.tokenizer.path)
    objective = build_objective(run, tokenizer)
    ids = tokenizer.encode("the scaling ladder " * 8).ids
    raw = objective.raw_length(run.data.seq_len)
    tokens = torch.tensor([(ids * (raw // max(1, len(ids)) + 1))[:raw]], dtype=torch.long)
    sample = objective(tokens, torch.Generator().manual_seed(0))
    return int(sample["decoder_input_ids"].shape[1])


def budget_label(value: float) -> str:
    return f"{value:.3g}".replace("e+0", "e").replace("e+", "e")


def plan_ladder(
    recipe: str | Path,
    overrides: list[str],
    out: str | os.PathLike,
    *,
    decoder_len: Callable[[RunConfig], int | None] = decoder_length,
) -> Plan:
    """Every cell of the ladder, checked (one line per problem) before anything runs."""
    ladder, _, run = load_ladder(recipe, overrides)
    out = Path(out).expanduser().resolve()
    t = run.trainer
    tokens_per_step = run.data.micro_batch_size * t.devices * t.num_nodes * t.accumulate_grad_batches
    tokens_per_step *= run.data.seq_len
    dec = decoder_len(run)
    group = ladder.group or f"ladder-{out.name}"
    kind = ladder.budget_kind
    plan = Plan(str(recipe), list(overrides), os.getcwd(), run.objective.name, run.model.arch, kind, group,
                tokens_per_step, run.data.seq_len, dec, ladder=asdict(ladder))  # fmt: skip
    shapes = [shape_of(size, run, ladder) for size in ladder.sizes]
    measured = {s: measure(run, s, run.data.seq_len, dec) for s in shapes}
    too_short = []
    for shape in shapes:
        params, per_token = measured[shape]
        for budget in ladder.budgets:
            target = budget / per_token if kind == "flops" else budget * params
            steps = max(1, round(target / tokens_per_step))
            name = f"d{shape.d_model}-l{shape.n_layer}"
            name += (
                f"-dl{shape.n_decoder_layer}" if shape.n_decoder_layer not in (None, shape.n_layer) else ""
            )
            name += f"-{'c' if kind == 'flops' else 'r'}{budget_label(budget)}"
            tokens = steps * tokens_per_step
            run_dir = out / "runs" / name
            cell = Cell(name, shape, budget, params, per_token, steps, tokens, tokens * per_token,
                        str(run_dir), str(run_dir / RECIPE_FILE))  # fmt: skip
            if steps < ladder.min_steps:
                too_short.append(f"{name} ({steps} steps)")
            plan.cells.append(cell)
    if too_short:
        raise InputError(
            f"the sizes do not span the budgets: {len(too_short)} cell(s) get fewer than ladder.min_steps="
            f"{ladder.min_steps} optimizer steps: {', '.join(too_short)}; raise the smallest budget, drop the "
            f"largest sizes or lower data.micro_batch_size"
        )
    if ladder.held_out == "largest":
        # the largest budget (planned, before steps are rounded), then the largest size
        max(plan.cells, key=lambda c: (c.budget if kind == "flops" else c.flops, c.params)).held_out = True
    fitted = len(plan.fitted)
    if fitted < 5:
        raise InputError(
            f"{fitted} cell(s) to fit 5 parameters (E, A, alpha, B, beta)"
            + (" besides the held-out one" if ladder.held_out == "largest" else "")
            + f": {len(shapes)} size(s) x {len(ladder.budgets)} budget(s) is too few; add ladder.sizes or budgets"
        )
    return plan


def cell_config(plan: Plan, cell: Cell, raw: dict[str, Any], ladder: LadderConfig) -> dict[str, Any]:
    """The cell's complete recipe (a resolved dict): the ladder recipe with the cell's shape and budget."""
    body = copy.deepcopy(raw)
    body["model"].update(cell.shape.overrides())
    body["name"], body["run_dir"], body["resume"] = cell.name, cell.run_dir, "auto"
    trainer = body.setdefault("trainer", {})
    trainer.update(max_steps=cell.steps, val_check_interval=cell.steps, limit_val_batches=ladder.val_batches)
    trainer["max_time_minutes"] = None
    body.setdefault("optim", {})["decay_steps"] = None
    every = max(1, math.ceil(cell.steps / ladder.checkpoints_per_cell))
    body["checkpoint"] = {**body.get("checkpoint", {}), "every_n_steps": every, "save_top_k": 0}
    logger = body.setdefault("logger", {})
    logger["csv"] = True
    logger.setdefault("wandb", {}).update(group=plan.group, name=cell.name)
    validate(copy.deepcopy(body))  # a cell that would not start is refused now, not hours in
    return body


def write_plan(plan: Plan, recipe: str | Path, overrides: list[str]) -> None:
    """``DIR/plan.json`` and each cell's ``recipe.yaml``; a directory holding another ladder is refused (its
    finished cells would not be this plan's)."""
    ladder, raw, _ = load_ladder(recipe, overrides)
    out = Path(plan.cells[0].run_dir).parents[1]
    previous = out / PLAN_FILE
    if previous.is_file():
        old = Plan.from_json(previous.read_text())
        if old.objective != plan.objective:
            raise InputError(
                f"{out} holds a ladder of objective {old.objective!r}; this recipe's is {plan.objective!r}: one fit "
                f"per objective, so give this ladder its own --out"
            )
    from pretrain.io import atomic_write_text

    bodies = {
        cell.name: yaml.safe_dump(cell_config(plan, cell, raw, ladder), sort_keys=False)
        for cell in plan.cells
    }
    for cell in plan.cells:
        path = Path(cell.recipe)
        if (
            path.is_file()
            and path.read_text() != bodies[cell.name]
            and any(path.parent.glob("checkpoints/*"))
        ):
            raise InputError(
                f"cell {cell.name} in {out} was run with another recipe than this ladder makes now; give the "
                f"changed ladder its own --out (or delete {path.parent} to rerun that cell)"
            )
    for cell in plan.cells:
        Path(cell.run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(cell.recipe, bodies[cell.name])
    atomic_write_text(previous, plan.to_json())


def read_plan(out: str | os.PathLike) -> Plan:
    path = Path(out) / PLAN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{out} holds no ladder ({PLAN_FILE} missing); run `pretrain ladder RECIPE --out {out}`"
        )
    plan = Plan.from_json(path.read_text())
    for cell in plan.cells:  # where the directory is now (it may have been moved or copied since)
        cell.run_dir = str(Path(out).resolve() / "runs" / cell.name)
        cell.recipe = str(Path(cell.run_dir) / RECIPE_FILE)
    return plan
