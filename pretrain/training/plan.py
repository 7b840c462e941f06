"""``pretrain plan RECIPE [key=value ...] --gpus N --gpu-memory 80GiB``: per-GPU memory of a training step under
each strategy, and the largest micro-batch that fits, before anything is allocated.

Traced, not guessed: the recipe's real model, optimizer (AdamW, its states made by a real ``step``), objective
batch, precision (autocast) and activation checkpointing run two training steps on fake tensors (no memory,
no compute), under torch's ``MemTracker``, which attributes every live tensor to parameters, gradients,
optimizer state or activations (``memory_compat.trace_peak``). Its peak, one device unsharded, is what a
single-device run allocates (validated within 15 % of real CPU steps in ``tests/integration/test_plan.py``).

Strategies then keep per GPU (N ranks; P parameters, G gradients at the peak, O optimizer state, A activations
and temporaries at the peak, all traced):

    ddp            P + G + O + A + G_all      the reducer's buckets: a copy of every gradient
    fsdp           traced: FSDP2 itself (the project's ``shard_model``, as training applies it) on a fake
                   process group of N ranks (torch's ``fake`` backend), rank 0's peak: its shards, the
                   all-gathered units alive at the peak ("comm"), gradients, optimizer state, activations
    fsdp-offload   that trace less the shards, their gradients and the optimizer state (on the CPU)
    zero1/2/3      DeepSpeed's own allocation rules (``zero_parts``) on the traced model, activations traced
                   with the model cast to 16 bits when DeepSpeed's bf16/fp16 runs it so (no autocast)
    zero2-offload  optimizer state (and the gradients it steps on) on the CPU
    zero3-offload  parameters too
    fsdp+tpT+cpC   with ``--tp T`` / ``--cp C``: the run's own parallelism (``strategies.parallelize``: context
                   parallelism, the model's tensor-parallel plan, FSDP2 over dp x cp) on a fake process group of N
                   ranks laid out dp x cp x tp (dp = N / (T C)), traced as rank 0 runs it: its tensor-parallel
                   shards of the parameters (FSDP2-sharded over dp x cp), gradients and optimizer state; the
                   activations of its T / C positions of every sequence, the all-gathered keys and values included

Validated against real gloo ranks (``tests/integration/test_plan.py``): the single-device trace, DDP, FSDP,
ZeRO-1/2/3, FSDP + TP=2 and FSDP + CP=2; not the offload rows (on the CPU, offloading moves nothing off the device).

The peak grows linearly with the micro-batch B (traced at B and 2 B), which gives the largest micro-batch
fitting ``0.9 x --gpu-memory`` (the rest: CUDA context, allocator fragmentation). Not modelled:
the CUDA context itself, NCCL's internal buffers, kernels' workspaces (cuBLAS, FlashAttention), compile-time
autotuning; the GPU check compares the plan with ``torch.cuda.max_memory_allocated`` (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pretrain.compat.dtensor import local_shard
from pretrain.config import RunConfig
from pretrain.errors import InputError

HEADROOM = 0.9  # of --gpu-memory usable by tensors
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
# DeepSpeed's ZeRO-3 defaults (``stage3_param_persistence_threshold``, ``stage3_prefetch_bucket_size``)
DS_PERSISTENCE_THRESHOLD = 100_000
DS_PREFETCH_ELEMENTS = 50_000_000
STRATEGIES = ("ddp", "fsdp", "fsdp-offload", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload")


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80G``, ``24GB`` (read as GiB, as GPU memory is quoted), ``512MiB`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise InputError(f"--gpu-memory {text!r} is not a size; write e.g. 80GiB, 40GiB or 24GiB")
    return int(float(match.group(1)) * UNITS[match.group(2)])


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one device's training step, unsharded, at its peak (traced)."""

    params: int  # parameters and buffers
    grads: int  # gradients alive at the peak
    all_grads: int  # gradients of every trainable parameter (what DDP's buckets copy)
    optimizer: int  # optimizer state
    activations: int  # activations and backward temporaries alive at the peak
    peak: int  # everything at the peak
    gathered: int = 0  # FSDP: unsharded parameters (all-gather outputs) alive at the peak
    numel: int = 0  # trainable parameter elements
    persistent: int = (
        0  # elements of the trainable parameters ZeRO-3 keeps whole (under DS_PERSISTENCE_THRESHOLD)
    )


def synthetic_batch(run: RunConfig, micro_batch: int, cp: int = 1) -> dict[str, torch.Tensor]:
    """The recipe's objective on random tokens when its tokenizer exists (shapes and target counts as in
    training); else a batch of the architecture's shape (MLM-like 15 % targets for encoders, a quarter-length
    decoder for encoder-decoders). ``cp > 1``: context-parallel rank 0's positions of it (``SequenceShard``, as
    the datamodule cuts it), its sparse targets' positions among them."""
    batch = _whole_batch(run, micro_batch)
    if cp == 1:
        return batch
    from pretrain.parallel.context import SequenceShard

    local = SequenceShard(0, cp)({k: v for k, v in batch.items() if k != "target_positions"})
    if "target_positions" in batch:
        local["target_positions"] = (local["labels"].flatten() != -100).nonzero().squeeze(1)
    return local


def _whole_batch(run: RunConfig, micro_batch: int) -> dict[str, torch.Tensor]:
    from pathlib import Path

    generator = torch.Generator().manual_seed(0)
    T, V = run.data.seq_len, run.model.vocab_size
    if Path(run.tokenizer.path).is_file():
        from pretrain.datamodules.tokenizer import load_tokenizer
        from pretrain.training.setup import build_objective

        objective = build_objective(run, load_tokenizer(run.tokenizer.path))
        tokens = torch.randint(4, V, (micro_batch, objective.raw_length(T)), generator=generator)
        batch = objective(tokens, generator)
        if objective.sparse_targets:
            batch["target_positions"] = (batch["labels"].flatten() != -100).nonzero().squeeze(1)
        return batch
    ids = torch.randint(4, V, (micro_batch, T), generator=generator)
    if run.model.arch == "decoder":
        return {"input_ids": ids, "labels": ids}
    if run.model.arch == "encoder":
        labels = torch.where(torch.rand(micro_batch, T, generator=generator) < 0.15, ids, -100)
        return {"input_ids": ids, "labels": labels,
                "target_positions": (labels.flatten() != -100).nonzero().squeeze(1)}  # fmt: skip
    dec = ids[:, : max(1, T // 4)]
    return {"input_ids": ids, "decoder_input_ids": dec, "labels": dec}


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, precision: str, tp: bool = False
) -> None:
    """One training step of ``model`` on ``batch``: forward, loss, backward, optimizer step; ``tp``: the loss and
    its backward under ``loss_parallel`` (vocabulary-sharded logits), as the training step runs them."""
    from pretrain.objectives.loss import token_cross_entropy
    from pretrain.parallel.tensor import vocabulary_parallel

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    if "target_positions" in batch:
        labels = labels.flatten()[batch["target_positions"]]
    device = next(model.parameters()).device.type
    amp = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed" else None
    amp = amp or (torch.autocast(device, dtype=torch.float16) if precision == "16-mixed" else None)
    with vocabulary_parallel(tp):
        with amp or contextlib.nullcontext():
            loss = token_cross_entropy(model(**inputs).logits, labels)[0]
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(run: RunConfig, checkpointing: bool, mesh: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model and optimizer; with a device ``mesh``, the model sharded by :func:`shard` first."""
    from pretrain.models.transformer import Transformer
    from pretrain.optim import build_optimizer

    dtype = torch.get_default_dtype()
    # bf16-true: made in bf16, as ``.to(torch.bfloat16)`` would make it (which cannot swap fake parameters)
    torch.set_default_dtype(torch.bfloat16 if run.trainer.precision == "bf16-true" else dtype)
    try:
        model = Transformer(run.model)
    finally:
        torch.set_default_dtype(dtype)
    model.check_inputs = False
    model.gradient_checkpointing = checkpointing
    if mesh is not None:
        shard(model, run, mesh)
    return model, build_optimizer(model, run.optim, amp=run.trainer.precision.endswith("-mixed"))


def shard(model: nn.Module, run: RunConfig, mesh: Any) -> None:
    """FSDP2 as ``strategy.fsdp`` shards in training: the project's ``shard_model`` on the LightningModule that
    holds ``model`` (each block, then the whole model as one unit: a tied LM head stays tied), resharding after
    forward unless ``sharding_strategy=SHARD_GRAD_OP``. With a ``RunMesh`` (tensor / context parallelism): the
    run's whole ``parallelize``, as ``strategy.fsdp`` applies it."""
    from pretrain.parallel.mesh import RunMesh
    from pretrain.training.strategies import parallelize, shard_model

    holder = nn.ModuleDict({"model": model})  # the LightningModule's place
    reshard = run.strategy.fsdp.sharding_strategy != "SHARD_GRAD_OP"
    if isinstance(mesh, RunMesh):
        parallelize(
            holder, mesh, sequence_parallel=run.strategy.sequence_parallel, reshard_after_forward=reshard
        )
    else:
        shard_model(holder, mesh, reshard_after_forward=reshard)


def trace(
    run: RunConfig, micro_batch: int, checkpointing: bool, gpus: int = 1, tp: int = 1, cp: int = 1
) -> StepMemory:
    """Two training steps of the recipe at ``micro_batch`` on fake tensors, measured by torch's MemTracker.
    ``gpus > 1``: under FSDP2 (the project's ``shard_model``, as ``strategy.fsdp`` shards) on a fake process
    group of that many ranks, as rank 0 sees it: ``params`` are its shards, ``gathered`` the unsharded
    parameters FSDP2 holds at the peak (all-gather outputs of the current and the prefetched unit). ``tp`` /
    ``cp`` > 1: the run's whole parallelism on the mesh dp x cp x tp of those ranks (module docstring), rank 0
    holding its ``micro_batch`` x seq_len / ``cp`` positions."""
    from pretrain.compat.memory import fake_mode, fake_process_group, meshes_outside_fake_mode, trace_peak
    from pretrain.parallel.mesh import ParallelDims

    batch = synthetic_batch(run, micro_batch, cp)  # real (small) integer tensors, made outside the fake mode
    group = fake_process_group(gpus) if gpus > 1 else contextlib.nullcontext()
    with group as mesh, meshes_outside_fake_mode():
        if tp * cp > 1:  # built outside the fake mode (a mesh reads real rank tensors)
            mesh = ParallelDims(1, gpus // (tp * cp), cp, tp).build("cpu")
        with fake_mode() as mode:
            model, optimizer = build(run, checkpointing, mesh)
            fake = {k: mode.from_tensor(v) for k, v in batch.items()}
            step = lambda: train_step(model, optimizer, fake, run.trainer.precision, tp > 1)
            snap = trace_peak(model, optimizer, step)
        local = {p: local_shard(p) for p in model.parameters()}
        all_grads = sum(t.nbytes for p, t in local.items() if p.requires_grad)
        held = snap["params"] if mesh is None else sum(t.nbytes for t in local.values())
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]  # global shapes
    return StepMemory(
        params=held, grads=snap["grads"], all_grads=all_grads, optimizer=snap["optimizer"],
        activations=snap["activations"], peak=snap["total"], gathered=snap["params"] - held,
        numel=sum(sizes), persistent=sum(k for k in sizes if k < DS_PERSISTENCE_THRESHOLD),
    )  # fmt: skip


@dataclass(frozen=True)
class Traces:
    """The traces a plan is computed from, at one micro-batch and checkpointing setting."""

    single: StepMemory  # one device, the recipe's precision
    sharded: StepMemory  # FSDP2 itself on the planned number of (fake) ranks
    low: StepMemory  # the model cast to its 16-bit compute dtype, no autocast: how DeepSpeed's bf16/fp16 runs it
    layout: StepMemory | None = None  # the run's tensor / context parallelism with FSDP2 (``fsdp+tp..+cp..``)


def layout_name(tp: int, cp: int) -> str:
    """The plan's row of FSDP2 with tensor parallelism ``tp`` and context parallelism ``cp``: ``fsdp+tp2+cp2``."""
    return "fsdp" + "".join(f"+{k}{v}" for k, v in (("tp", tp), ("cp", cp)) if v > 1)


def strategies(run: RunConfig) -> tuple[str, ...]:
    """The plan's rows: every strategy, and the run's own tensor / context parallelism where it has any."""
    tp, cp = run.strategy.tensor_parallel, run.strategy.context_parallel
    return STRATEGIES + ((layout_name(tp, cp),) if tp * cp > 1 else ())


def traces(run: RunConfig, micro_batch: int, checkpointing: bool, gpus: int) -> Traces:
    """What :func:`per_gpu` needs for ``gpus`` ranks (one trace of each kind, the same one where they agree)."""
    single = trace(run, micro_batch, checkpointing)
    sharded = trace(run, micro_batch, checkpointing, gpus) if gpus > 1 else single
    low = single
    if run.trainer.precision in ("bf16-mixed", "16-mixed"):
        low = trace(
            replace(run, trainer=replace(run.trainer, precision="bf16-true")), micro_batch, checkpointing
        )
    tp, cp = run.strategy.tensor_parallel, run.strategy.context_parallel
    layout = trace(run, micro_batch, checkpointing, gpus, tp, cp) if tp * cp > 1 else None
    return Traces(single, sharded, low, layout)


def per_gpu(t: Traces, strategy: str, gpus: int, run: RunConfig) -> dict[str, int]:
    """Per-GPU bytes under ``strategy`` on ``gpus`` ranks (the module docstring's table)."""
    step = t.single
    if strategy.startswith("fsdp"):
        s = t.layout if strategy.startswith("fsdp+") else t.sharded
        assert s is not None, f"{strategy}: traced without the run's tensor / context parallelism"
        offload = strategy.endswith("offload")  # shards, their gradients and the optimizer live on the CPU
        parts = {"params": 0 if offload else s.params, "grads": 0 if offload else s.grads,
                 "optimizer": 0 if offload else s.optimizer, "comm": s.gathered}  # fmt: skip
        return {**parts, "activations": s.activations, "total": sum(parts.values()) + s.activations}
    if strategy == "ddp":  # the reducer's buckets: a copy of every gradient
        parts = {"params": step.params, "grads": step.grads, "optimizer": step.optimizer,
                 "comm": step.all_grads}  # fmt: skip
        A = step.activations
    else:
        parts = zero_parts(step, int(strategy[4]), strategy.endswith("offload"), gpus, run, t.low.grads)
        A = t.low.activations
    return {**parts, "activations": A, "total": sum(parts.values()) + A}


def zero_parts(
    step: StepMemory, stage: int, offload: bool, n: int, run: RunConfig, live_grads: int
) -> dict[str, int]:
    """DeepSpeed ZeRO's per-rank memory by its own allocation rules (deepspeed 0.19.8 ``runtime/zero``) on the
    traced model's E parameter elements, c bytes each in the compute dtype (2 under DeepSpeed's bf16/fp16, else
    4): the model whole (stages 1-2), or (stage 3) its flat partition E c / n, the parameters under
    ``DS_PERSISTENCE_THRESHOLD`` elements kept whole and the others gathered ahead of use (up to
    ``DS_PREFETCH_ELEMENTS``); an fp32 master partition and the optimizer's moments (fp32) on E / n elements;
    stage 3's fp32 flat buffer of gradient partitions (E / n; stages 1-2 make theirs at the step, past the
    peak); the gradient reduction buffers, ``reduce_bucket_size`` elements of c whatever the model's size, two
    of them under ``overlap_comm`` for stages 1-2 (``setup_buckets``), one for stage 3; and ``live_grads``, the
    gradients autograd holds at the traced peak (with activation checkpointing the peak is in backward) before
    DeepSpeed's hooks move them into its buckets."""
    ds, E = run.strategy.deepspeed, step.numel
    c = 2 if run.trainer.precision in ("bf16-mixed", "16-mixed", "bf16-true") else 4
    params = E * c
    if stage == 3:
        gathered = min(E - step.persistent, DS_PREFETCH_ELEMENTS)
        params = E * c // n + (step.persistent + gathered) * c
    traced_bytes = 2 if run.trainer.precision == "bf16-true" else 4  # per element of the traced AdamW's state
    moments = step.optimizer * 4 // traced_bytes  # kept in fp32 by DeepSpeed
    buffers = (2 if ds.overlap_comm and stage < 3 else 1) * ds.reduce_bucket_size * c
    return {
        "params": 0 if stage == 3 and offload else params,
        "grads": live_grads + (E * 4 // n if stage == 3 and not offload else 0),
        "optimizer": 0 if offload else (E * 4 + moments) // n,
        "comm": buffers if ds.contiguous_gradients else 0,
    }


@dataclass(frozen=True)
class PlanRow:
    strategy: str
    checkpointing: bool
    parts: dict[str, int]
    max_micro_batch: int  # 0: not even one sample fits


def plan(run: RunConfig, gpus: int, gpu_memory: int) -> list[PlanRow]:
    """Every strategy x activation checkpointing at the configured micro-batch, with the largest that fits
    (``run.strategy.tensor_parallel`` / ``context_parallel`` > 1: a row of that layout too, checked by
    :func:`with_layout`)."""
    B = run.data.micro_batch_size
    tp, cp = run.strategy.tensor_parallel, run.strategy.context_parallel
    rows = []
    for checkpointing in (False, True):
        at, twice = traces(run, B, checkpointing, gpus), trace(run, 2 * B, checkpointing)
        per_sample = max(1, (twice.peak - at.single.peak) // B)  # bytes the peak grows by per sample
        for strategy in strategies(run):
            if strategy.startswith("fsdp+"):  # a rank's T / cp positions of each sample: its own growth
                assert at.layout is not None
                layout_twice = trace(run, 2 * B, checkpointing, gpus, tp, cp)
                per_sample = max(1, (layout_twice.peak - at.layout.peak) // B)
            parts = per_gpu(at, strategy, gpus, run)
            room = int(HEADROOM * gpu_memory) - parts["total"]
            most = B + room // per_sample if room >= 0 else B - -(-room // per_sample)
            rows.append(PlanRow(strategy, checkpointing, parts, max(0, most)))
    return rows


def format_table(rows: list[PlanRow], run: RunConfig, gpus: int, gpu_memory: int) -> str:
    gib = 2**30
    head = (f"per-GPU memory (GiB) of one training step: {run.name}, micro-batch {run.data.micro_batch_size} x "
            f"{run.data.seq_len} tokens, {run.trainer.precision}, {gpus} GPU(s) of {gpu_memory / gib:.0f} GiB "
            f"(fits: {HEADROOM:.0%} of it)")  # fmt: skip
    tp, cp = run.strategy.tensor_parallel, run.strategy.context_parallel
    if tp * cp > 1:
        head += f"; {layout_name(tp, cp)}: dp {gpus // (tp * cp)} x cp {cp} x tp {tp}"
    cols = ["params", "grads", "optimizer", "activations", "comm", "total"]
    lines = [
        head,
        f"{'strategy':<15}{'ckpt':<6}" + "".join(f"{c:>12}" for c in cols) + f"{'max micro-batch':>17}",
    ]
    for r in rows:
        cells = "".join(f"{r.parts[c] / gib:>12.3f}" for c in cols)
        fits = "" if r.parts["total"] <= HEADROOM * gpu_memory else "  (configured: does not fit)"
        lines.append(
            f"{r.strategy:<15}{'on' if r.checkpointing else 'off':<6}{cells}{r.max_micro_batch:>17}{fits}"
        )
    return "\n".join(lines)


def with_layout(run: RunConfig, gpus: int, tp: int, cp: int) -> RunConfig:
    """``run`` with tensor parallelism ``tp`` and context parallelism ``cp`` on ``gpus`` ranks of FSDP2, as
    :func:`plan` traces it; ``InputError`` in one line for a layout training would refuse
    (``pretrain.parallel.mesh.parallel_problems``)."""
    from pretrain.parallel.mesh import parallel_problems

    if tp < 1 or cp < 1:
        raise InputError(f"--tp and --cp must be >= 1, got --tp {tp} --cp {cp}")
    if gpus % (tp * cp):
        raise InputError(
            f"--gpus {gpus} is not a multiple of --tp {tp} x --cp {cp} = {tp * cp}: each data-parallel rank is "
            f"a group of tp x cp GPUs; pick --gpus that is"
        )
    s = run.strategy
    strategy = replace(
        s, tensor_parallel=tp, context_parallel=cp, sequence_parallel=s.sequence_parallel and tp > 1
    )
    if tp * cp > 1:
        strategy = replace(strategy, name="fsdp", fsdp=replace(s.fsdp, cpu_offload=False))
    cell = replace(
        run,
        strategy=strategy,
        trainer=replace(run.trainer, devices=gpus, num_nodes=1, float8=False),
        eval_during_fit=replace(run.eval_during_fit, tasks=[]),  # a training-time refusal, not a memory one
    )
    if problems := parallel_problems(cell):
        raise InputError(problems[0])
    return cell


def summary(rows: list[PlanRow]) -> dict[str, Any]:
    """``{strategy[+ckpt]: total bytes}``: the plan as data (the GPU check compares it with the measured peak)."""
    return {f"{r.strategy}{'+ckpt' if r.checkpointing else ''}": r.parts["total"] for r in rows}
