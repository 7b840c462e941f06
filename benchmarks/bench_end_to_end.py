"""End to end: ``pretrain fit`` vs a nanoGPT-style loop, the transformers ``Trainer`` and ``litgpt pretrain``.

Every contender trains the same GPT shape (GPT-2 layout; ``--layers``, ``--d-model``, 4 heads, MLP 4d, vocab
1024, tied embeddings, no dropout -- litgpt's GPT has none) on the same tokens (Tiny Shakespeare, the BPE and
prepared split of the ``gpt-tiny`` recipe), with the same batch (``--batch`` x ``--seq-len``), AdamW
(lr 2e-3, betas 0.9/0.95, weight decay 0.1), 30 warm-up steps then cosine to 10 %, clipping at 1.0, a
validation pass of 8 batches every ``--eval-every`` steps and a log line every 10 steps:

* ``pretrain``: ``pretrain fit recipes/gpt-tiny.yaml`` in-process (``prepare_run`` + ``build_trainer``, as
  ``pretrain.cli.fit``; CSV logger, throughput monitor, checkpoint callbacks; W&B off).
* ``nanogpt``: nanoGPT's ``train.py`` loop (random-offset batches from the token array, its AdamW groups and
  ``get_lr``, ``estimate_loss`` on val) over ``transformers.GPT2LMHeadModel`` (SDPA attention, GPT-2's tanh
  GELU as ``gelu_pytorch_tanh``: one ATen op; ``gelu_new`` spells the same function in 8 ops, 1.3x slower).
* ``hf_trainer``: the ``run_clm`` recipe's training part: the token stream grouped into blocks, ``Trainer``
  with ``cosine_with_min_lr``, ``eval_strategy="steps"``.
* ``litgpt``: ``litgpt.pretrain.setup`` with a ``Config`` of the same shape (RoPE in place of learned
  positions: litgpt has no learned positions) and a data module of random-offset windows; litgpt compiles
  the model with ``torch.compile`` (its default), so its loop time includes inductor's compile.
  ``litgpt_eager`` is the same run with ``torch.compile`` turned into the identity. Both are compared with
  ``pretrain_rope``: ``pretrain fit`` with ``model.position=rope``, litgpt's positions.

Each contender runs in its own process (``--threads`` torch threads), contenders interleaved over
``--rounds``. Timing uses the process CPU clock (the machine is shared: CPU seconds are what a dedicated
core would take) from the start of the first training step to the end of training, periodic validation
and logging included; model construction, data set-up and the final checkpoint are outside. Reported:
tokens/s of that loop, the median CPU time of one training step (steady state), and the validation loss of
the final weights on the same fixed windows (all non-overlapping ``seq_len + 1`` windows of the val split),
which must agree within 0.02 for the speeds to compare equal training.

    python benchmarks/bench_end_to_end.py [--steps 150] [--rounds 1] [--threads 1] [--only pretrain,nanogpt]
    python benchmarks/bench_end_to_end.py --only pretrain_rope,litgpt_eager,litgpt
    python benchmarks/bench_end_to_end.py --profile   # torch.profiler breakdown of pretrain fit's step
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = (
    "pretrain",
    "nanogpt",
    "hf_trainer",
    "litgpt",
    "litgpt_eager",
    "pretrain_rope",
    "pretrain_compiled",
)
LR, MIN_LR_RATIO, WARMUP, WEIGHT_DECAY, BETAS, CLIP = 2e-3, 0.1, 30, 0.1, (0.9, 0.95), 1.0
VAL_BATCHES, LOG_EVERY, VOCAB, HEADS = 8, 10, 1024, 4


def cpu() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler runs of torch.compile)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class Clock:
    """CPU time at the start of the first step, at every step end and at the end of training."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.steps: list[float] = []
        self.end: float | None = None

    def step_start(self) -> None:
        if self.start is None:
            self.start = cpu()

    def step_end(self) -> None:
        self.steps.append(cpu())

    def result(self, tokens_per_step: int) -> dict:
        end = self.end if self.end is not None else self.steps[-1]
        diffs = np.diff(self.steps)
        return {
            "steps": len(self.steps),
            "loop_cpu_s": end - self.start,
            "tokens_per_s": len(self.steps) * tokens_per_step / (end - self.start),
            "step_ms": 1000 * float(np.median(diffs)),
        }


# ---------------------------------------------------------------------------------------------- data
def prepare_data(work: Path) -> None:
    """The gpt-tiny recipe's tokenizer and prepared split, built in ``work``."""
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import train_bpe

    corpus = REPO / "recipes" / "data" / "tinyshakespeare.txt"
    train_bpe([corpus], VOCAB, work / "tokenizer.json", min_frequency=2, show_progress=False)
    prepare([corpus], work / "tokenizer.json", work / "data", val_fraction=0.05, progress=False)


def token_array(work: Path, split: str) -> np.ndarray:
    from pretrain.datamodules.indexed import IndexedDataset

    return np.asarray(IndexedDataset(work / "data" / split).tokens, dtype=np.int64)


def val_windows(work: Path, seq_len: int) -> torch.Tensor:
    """``(N, seq_len + 1)``: every non-overlapping window of the val split (the common final yardstick)."""
    val = token_array(work, "val")
    n = len(val) // (seq_len + 1)
    return torch.from_numpy(val[: n * (seq_len + 1)].reshape(n, seq_len + 1))


@torch.no_grad()
def final_val_loss(logits_fn, windows: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = logits_fn(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


def cosine_lr(step: int, max_steps: int) -> float:
    """nanoGPT's ``get_lr``: linear warm-up, cosine to ``MIN_LR_RATIO * LR``."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    ratio = min(1.0, (step - WARMUP) / max(1, max_steps - WARMUP))
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * ratio)))


def gpt2_config(args: argparse.Namespace):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=args.seq_len + 1,  # run_clm's blocks hold seq_len + 1 tokens
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=HEADS,
        n_inner=4 * args.d_model,
        activation_function="gelu_pytorch_tanh",  # gelu_new's math, one fused op
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )


# ---------------------------------------------------------------------------------------------- contenders
def run_pretrain(
    work: Path,
    args: argparse.Namespace,
    callbacks: tuple = (),
    compile: bool = False,
    position: str = "learned",
) -> dict:
    from lightning.pytorch.callbacks import Callback

    from pretrain import config
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    clock = Clock()

    class StepClock(Callback):
        def on_train_batch_start(self, *_):
            clock.step_start()

        def on_train_batch_end(self, *_):
            clock.step_end()

        def on_train_end(self, *_):
            clock.end = cpu()

    overrides = [
        f"tokenizer.path={work / 'tokenizer.json'}",
        f"data.sources.0.prepared={work / 'data'}",
        f"run_dir={work / 'runs' / 'pretrain'}",
        "resume=null",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.eval_every}",
        f"trainer.limit_val_batches={VAL_BATCHES}",
        f"trainer.log_every_n_steps={LOG_EVERY}",
        f"checkpoint.every_n_steps={10 * args.steps}",
        "checkpoint.save_top_k=0",
        "trainer.progress_bar=false",
        "logger.wandb.enabled=false",
        f"model.n_layer={args.layers}",
        f"model.d_model={args.d_model}",
        f"model.d_ff={4 * args.d_model}",
        f"model.n_head={HEADS}",
        f"model.max_seq_len={args.seq_len}",
        "model.dropout=0.0",
        f"data.micro_batch_size={args.batch}",
        f"data.seq_len={args.seq_len}",
        f"optim.lr={LR}",
        f"optim.warmup_steps={WARMUP}",
        f"optim.min_lr_ratio={MIN_LR_RATIO}",
        f"trainer.gradient_clip_val={CLIP}",
        f"trainer.compile={str(compile).lower()}",
        f"model.position={position}",
    ]
    run, resolved = config.load(REPO / "recipes" / "gpt-tiny.yaml", overrides)
    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved, callbacks=[StepClock(), *callbacks])
    trainer.fit(parts.module, datamodule=parts.datamodule)
    model = parts.module.model.eval()
    out = clock.result(args.batch * args.seq_len)
    out["val_loss"] = final_val_loss(lambda x: model(x).logits, val_windows(work, args.seq_len), args.batch)
    return out


def run_nanogpt(work: Path, args: argparse.Namespace) -> dict:
    """nanoGPT train.py's loop, GPT2LMHeadModel as the model."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1337)
    model = GPT2LMHeadModel(gpt2_config(args))
    train, val = token_array(work, "train"), token_array(work, "val")
    gen = torch.Generator().manual_seed(1337)

    def get_batch(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - args.seq_len - 1, (args.batch,), generator=gen).tolist()
        x = torch.from_numpy(np.stack([data[i : i + args.seq_len] for i in ix]))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + args.seq_len] for i in ix]))
        return x, y

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = torch.stack([loss_of(*get_batch(val)) for _ in range(VAL_BATCHES)])
        model.train()
        return losses.mean().item()

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
    clock = Clock()
    model.train()
    x, y = get_batch(train)
    for step in range(args.steps):
        clock.step_start()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, args.steps)
        if step > 0 and step % args.eval_every == 0:
            print(f"step {step}: val loss {estimate_loss():.4f}", file=sys.stderr)
        loss = loss_of(x, y)
        x, y = get_batch(train)  # nanoGPT fetches the next batch while the backward runs (async on GPU)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"iter {step}: loss {loss.item():.4f}", file=sys.stderr)
        clock.step_end()
    estimate_loss()  # the final eval nanoGPT's loop runs at max_iters
    clock.end = cpu()
    out = clock.result(args.batch * args.seq_len)
    model.eval()
    out["val_loss"] = final_val_loss(lambda x: model(x).logits, val_windows(work, args.seq_len), args.batch)
    return out


def run_hf_trainer(work: Path, args: argparse.Namespace) -> dict:
    """run_clm's training part: grouped blocks, ``Trainer`` (labels = input_ids, shifted in the model)."""
    import datasets
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    datasets.disable_progress_bars()
    block = args.seq_len + 1  # the same number of predictions per block as the other contenders

    def blocks(split: str, limit: int | None = None) -> datasets.Dataset:
        tokens = token_array(work, split)
        n = len(tokens) // block if limit is None else min(limit, len(tokens) // block)
        ids = tokens[: n * block].reshape(n, block).tolist()
        return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})

    clock = Clock()

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            clock.step_start()

        def on_step_end(self, *_, **__):
            clock.step_end()

        def on_train_end(self, *_, **__):
            clock.end = cpu()

    torch.manual_seed(1337)
    model = GPT2LMHeadModel(gpt2_config(args))
    training_args = TrainingArguments(
        output_dir=str(work / "runs" / "hf_trainer"),
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
        warmup_steps=WARMUP,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        max_grad_norm=CLIP,
        logging_steps=LOG_EVERY,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=1337,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=blocks("train"),
        eval_dataset=blocks("val", VAL_BATCHES * args.batch),
        callbacks=[StepClock()],
    )
    trainer.train()
    out = clock.result(args.batch * args.seq_len)
    model.eval()
    out["val_loss"] = final_val_loss(lambda x: model(x).logits, val_windows(work, args.seq_len), args.batch)
    return out


class Windows(torch.utils.data.IterableDataset):
    """Random-offset ``(T + 1)``-token windows of a token array (litgpt's data module)."""

    def __init__(self, tokens: np.ndarray, length: int, seed: int):
        self.tokens, self.length, self.seed = tokens, length, seed

    def __iter__(self):
        gen = np.random.default_rng(self.seed)
        while True:
            i = int(gen.integers(len(self.tokens) - self.length))
            yield torch.from_numpy(self.tokens[i : i + self.length])


class Stamped:
    """A loader that stamps ``clock`` at every batch it hands out (a step ends where the next one starts)."""

    def __init__(self, loader, clock: Clock):
        self.loader, self.clock = loader, clock

    def __len__(self) -> int:
        return 10**9

    def __iter__(self):
        for batch in self.loader:
            if self.clock.start is not None:
                self.clock.step_end()
            self.clock.step_start()
            yield batch


def run_litgpt(work: Path, args: argparse.Namespace, compile: bool = True) -> dict:
    import litgpt.pretrain as lp
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule
    from torch.utils.data import DataLoader

    clock = Clock()
    train_tokens, val_tokens = token_array(work, "train"), token_array(work, "val")

    class Data(DataModule):
        def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
            self.batch_size, self.length = batch_size, max_seq_length + 1

        def train_dataloader(self):
            return Stamped(
                DataLoader(Windows(train_tokens, self.length, 0), batch_size=self.batch_size), clock
            )

        def val_dataloader(self):
            return DataLoader(Windows(val_tokens, self.length, 1), batch_size=self.batch_size)

    config = Config(
        name="gpt2-shape",
        block_size=args.seq_len,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=args.layers,
        n_head=HEADS,
        n_embd=args.d_model,
        n_query_groups=HEADS,
        intermediate_size=4 * args.d_model,
        bias=True,
        parallel_residual=False,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        gelu_approximate="tanh",
        rotary_percentage=1.0,
    )
    original_setup = lp.L.Fabric.setup_dataloaders
    lp.L.Fabric.setup_dataloaders = lambda self, *loaders, **kw: loaders  # keep our stamped iterable
    trained = {}
    # the final checkpoint is outside the timed loop (as for the other contenders): keep the model instead
    lp.save_checkpoint = lambda fabric, state, *a, **kw: trained.update(model=state["model"])
    if not compile:
        lp.torch.compile = lambda model, *a, **kw: model
    out_dir = work / "runs" / "litgpt"
    try:
        lp.setup(
            "gpt2-shape",
            model_config=config,
            out_dir=out_dir,
            precision="32-true",
            data=Data(),
            train=TrainArgs(
                save_interval=None,
                log_interval=LOG_EVERY,
                global_batch_size=args.batch,
                micro_batch_size=args.batch,
                max_tokens=args.steps * args.batch * args.seq_len,
                max_seq_length=args.seq_len,
                lr_warmup_steps=WARMUP,
                max_norm=CLIP,
                min_lr=LR * MIN_LR_RATIO,
                tie_embeddings=True,
            ),
            eval=EvalArgs(interval=args.eval_every, max_iters=VAL_BATCHES, final_validation=True),
            optimizer={
                "class_path": "torch.optim.AdamW",
                "init_args": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS)},
            },
            devices=1,
            logger_name="csv",
            seed=1337,
        )
    finally:
        lp.L.Fabric.setup_dataloaders = original_setup
    clock.step_end()  # the last step ended before setup returned (final validation and save included)
    clock.end = clock.steps[-1]
    out = clock.result(args.batch * args.seq_len)
    model = trained["model"].eval()
    out["val_loss"] = final_val_loss(model, val_windows(work, args.seq_len), args.batch)
    return out


RUNNERS = {
    "pretrain": run_pretrain,
    "nanogpt": run_nanogpt,
    "hf_trainer": run_hf_trainer,
    "litgpt": run_litgpt,
    "litgpt_eager": lambda work, args: run_litgpt(work, args, compile=False),
    "pretrain_rope": lambda work, args: run_pretrain(work, args, position="rope"),  # litgpt's positions
    "pretrain_compiled": lambda work, args: run_pretrain(work, args, compile=True),  # bench_compile.py
}


# ---------------------------------------------------------------------------------------------- profile
PHASES = ("data + loop", "forward + loss", "backward", "clip + optimizer + callbacks")


def phase_clock():
    """A Lightning callback stamping the CPU clock at the hooks that bound the phases of a training step."""
    from lightning.pytorch.callbacks import Callback

    class PhaseClock(Callback):
        def __init__(self) -> None:
            self.stamps: list[list[float]] = []
            self.last_end: float | None = None

        def on_train_batch_start(self, *_):
            self.current = [self.last_end if self.last_end is not None else cpu(), cpu()]

        def on_before_backward(self, *_):
            self.current.append(cpu())

        def on_after_backward(self, *_):
            self.current.append(cpu())

        def on_train_batch_end(self, *_):
            self.last_end = cpu()
            self.stamps.append([*self.current, self.last_end])

        def breakdown(self) -> dict[str, float]:
            """Median CPU ms of each phase (steps after the first 5)."""
            diffs = np.diff(np.array(self.stamps[5:]), axis=1) * 1000
            return {name: float(np.median(diffs[:, i])) for i, name in enumerate(PHASES)}

    return PhaseClock()


def profile_pretrain(work: Path, args: argparse.Namespace) -> None:
    """torch.profiler's top operators over 12 steps of pretrain fit, then the step-time breakdown (CPU ms
    per phase, median) of a ``--steps`` run without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_pretrain(work, argparse.Namespace(**{**vars(args), "steps": 12}))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    clock = phase_clock()
    run_pretrain(work, args, callbacks=[clock])
    phases = clock.breakdown()
    print(f"pretrain fit step, median CPU ms per phase over {args.steps} steps:")
    for name, ms in phases.items():
        print(f"  {name:<30}{ms:8.1f}")
    print(f"  {'total':<30}{sum(phases.values()):8.1f}")


# ---------------------------------------------------------------------------------------------- driver
def child(name: str, work: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # compile in-process: its compiler runs are our children
    cmd = [sys.executable, __file__, "--child", name, "--work", str(work)]
    for key in ("steps", "batch", "seq_len", "layers", "d_model", "eval_every", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"{name} failed:\n{tail}", file=sys.stderr)
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_run_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The run's shape, length and threads (shared with ``bench_compile.py``)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, steps=150)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default=",".join(CONTENDERS[:4]), help=f"comma list of {CONTENDERS}")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        result = RUNNERS[args.child](args.work, args)
        print(json.dumps(result))
        return
    names = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_data(work)
        if args.profile:
            profile_pretrain(work, args)
            return
        results: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                results[name].append(child(name, work, args))
                res = results[name][-1]
                if res:
                    print(
                        f"round {r} {name:<13} {res['tokens_per_s']:8.0f} tokens/CPU-s  step {res['step_ms']:6.1f} "
                        f"ms  loop {res['loop_cpu_s']:6.1f} CPU-s  final val loss {res['val_loss']:.4f}",
                        flush=True,
                    )
    med = {
        name: {key: statistics.median(r[key] for r in rs if r) for key in rs[0]}
        for name, rs in results.items()
        if rs and all(rs)
    }
    print(
        f"\nGPT L={args.layers} d={args.d_model} vocab {VOCAB}, batch {args.batch} x {args.seq_len}, "
        f"{args.steps} steps, eval every {args.eval_every}, {args.threads} thread(s), medians of {args.rounds} "
        f"round(s), CPU clock"
    )
    print(f"{'contender':<14}{'tokens/s':>10}{'step ms':>9}{'val loss':>10}")
    for name, m in med.items():
        print(f"{name:<14}{m['tokens_per_s']:>10.0f}{m['step_ms']:>9.1f}{m['val_loss']:>10.4f}")
    targets = {"nanogpt": 1.15, "hf_trainer": 1.3, "litgpt": 1.3, "litgpt_eager": 1.3}
    for name, target in targets.items():
        # litgpt's GPT has rotary positions: it is compared with pretrain's model.position=rope run
        mine = "pretrain_rope" if name.startswith("litgpt") and "pretrain_rope" in med else "pretrain"
        if name in med and mine in med:
            ours, peer = med[mine], med[name]
            dloss = ours["val_loss"] - peer["val_loss"]
            print(
                f"{mine} / {name}: loop tokens/s {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x, "
                f"steady step {peer['step_ms'] / ours['step_ms']:.2f}x (target >= {target}); "
                f"val loss difference {dloss:+.3f} ({'within' if abs(dloss) <= 0.02 else 'OUTSIDE'} 0.02)"
            )


if __name__ == "__main__":
    main()
