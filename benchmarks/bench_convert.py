"""Peak memory of converting a sharded checkpoint: ``pretrain convert --to single`` (``consolidate``: tensor by
tensor) against the whole-checkpoint conversion it replaces (every tensor read into memory, then ``torch.save``),
and ``pretrain merge`` of two such checkpoints. Then from a checkpoint file (the 124M model's real parameters,
random, with AdamW's moments by position, as a single-process run writes it): ``pretrain convert --to dcp``
(each tensor copied out of the file's mapping, the pages released) against writing the mapped tensors themselves
(before), and ``pretrain convert --to hf`` (``pretrain export``: tensor by tensor) against the model loaded whole
and ``save_pretrained`` (before), whose fixed overhead imports transformers too.

The checkpoint: the GPT-2 124M shape (vocab 50304, d=768, 12 layers) with AdamW's two moments and step, written
by 2 gloo ranks as FSDP2 writes it (each tensor sharded on dim 0, a ``torch.distributed.checkpoint`` directory
with ``meta.pt``): 1.5 GB, its largest tensor the 154.5 MB embedding. Each conversion runs in a fresh process
whose peak resident memory (``ru_maxrss``) is reported, next to the peak of a process that only imports the same
modules and reads the checkpoint's metadata (the fixed overhead).

    python benchmarks/bench_convert.py [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # name -> shape: the 124M GPT-2 (tied head), weights only; moments have the same shapes
    "model.embed.tok.weight": (50304, 768),
    "model.embed.pos.weight": (1024, 768),
    **{
        f"model.decoder.blocks.{i}.{name}": shape
        for i in range(12)
        for name, shape in (
            ("norm1.weight", (768,)),
            ("norm1.bias", (768,)),
            ("attn.qkv.weight", (2304, 768)),
            ("attn.qkv.bias", (2304,)),
            ("attn.out.weight", (768, 768)),
            ("attn.out.bias", (768,)),
            ("norm2.weight", (768,)),
            ("norm2.bias", (768,)),
            ("mlp.fc.weight", (3072, 768)),
            ("mlp.fc.bias", (3072,)),
            ("mlp.proj.weight", (768, 3072)),
            ("mlp.proj.bias", (768,)),
        )
    },
    "model.decoder.norm.weight": (768,),
    "model.decoder.norm.bias": (768,),
}


def write_rank(out: str, seed: int) -> None:
    """One of 2 gloo ranks: its dim-0 shard of every tensor, saved with DCP (rank 0 adds meta.pt)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(seed * 100 + rank)

    def shard(shape: tuple[int, ...]) -> DTensor:
        rows = (shape[0] + world - 1) // world
        local = torch.randn((max(0, min(rows, shape[0] - rank * rows)), *shape[1:]), generator=generator)
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    state = {"state_dict": {n: shard(s) for n, s in SHAPES.items()}}
    moments = {
        n: {"step": torch.tensor(100.0), "exp_avg": shard(s), "exp_avg_sq": shard(s)}
        for n, s in SHAPES.items()
    }
    names = list(SHAPES)
    decay = [n for n in names if n.endswith("weight") and "norm" not in n and "embed" not in n]
    groups = [
        {"name": "decay", "lr": 6e-4, "weight_decay": 0.1, "params": decay},
        {"name": "no_decay", "lr": 6e-4, "weight_decay": 0.0, "params": [n for n in names if n not in decay]},
    ]
    state["optimizer_0"] = {"state": moments, "param_groups": groups}
    dcp.save(state, checkpoint_id=out)
    if rank == 0:
        from pretrain.checkpoint.io import METADATA, PAYLOAD

        model = {
            "arch": "decoder",
            "vocab_size": 50304,
            "d_model": 768,
            "n_layer": 12,
            "n_head": 12,
            "d_ff": 3072,
        }
        meta = {"global_step": 100, "epoch": 0, PAYLOAD: {"config": {"model": model}, "tokenizer_json": None}}
        torch.save(meta, Path(out) / METADATA)
    dist.destroy_process_group()


MODEL = {"arch": "decoder", "vocab_size": 50304, "d_model": 768, "n_layer": 12, "n_head": 12, "d_ff": 3072}


def write_file(out: str) -> None:
    """A checkpoint file of the 124M model (random weights, AdamW moments by position), as `pretrain fit` writes."""
    import torch

    from pretrain.checkpoint.io import PAYLOAD
    from pretrain.checkpoint.optimizer_state import optimizer_state_by_position
    from pretrain.models.config import ModelConfig
    from pretrain.models.transformer import Transformer
    from pretrain.optim import group_param_names

    torch.manual_seed(3)
    model = Transformer(ModelConfig(**MODEL))  # random weights; a tied head shares the embedding's storage
    state = {"model." + n: t for n, t in model.state_dict().items()}
    groups = group_param_names(ModelConfig(**MODEL), 0.1, muon=False)
    names = [n for group in groups for n in group]
    moments = {
        n: {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn_like(state[n]),
            "exp_avg_sq": torch.rand_like(state[n]),
        }
        for n in names
    }
    optimizer = optimizer_state_by_position(
        {
            "state": moments,
            "param_groups": [
                {"lr": 6e-4, "weight_decay": decay, "params": group}
                for decay, group in zip((0.1, 0.0), groups, strict=True)
            ],
        }
    )
    config = {"model": MODEL, "optim": {"name": "adamw", "weight_decay": 0.1}}
    checkpoint = {
        "global_step": 100,
        "epoch": 0,
        "state_dict": state,
        "optimizer_states": [optimizer],
        PAYLOAD: {"config": config, "tokenizer_json": None},
    }
    torch.save(checkpoint, out)


def measure(task: str, *args: str) -> dict:
    """Peak RSS (MiB) and wall seconds of ``task`` in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--task", task, *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def task(name: str, args: list[str]) -> None:
    import time

    from pretrain.checkpoint import dcp
    from pretrain.checkpoint.convert import consolidate, full_checkpoint
    from pretrain.checkpoint.merge import merge

    start = time.perf_counter()
    if name == "overhead":
        dcp.metadata(args[0])
    elif name == "streaming":
        consolidate(args[0], args[1])
    elif name == "whole":  # the consolidation this replaces: every tensor in memory, then one write
        from pretrain.checkpoint.lightning_io import AtomicCheckpointIO

        AtomicCheckpointIO().save_checkpoint(full_checkpoint(args[0]), args[1])
    elif name == "merge":
        merge(args[:2], args[2])
    elif name == "file-overhead":  # the imports of --to dcp, and the file's structure read (mapped)
        import torch.distributed.checkpoint  # noqa: F401

        from pretrain.checkpoint.io import read
        from pretrain.checkpoint.stream import convert
        from pretrain.optim import group_param_names  # noqa: F401

        read(args[0], mmap=True)
    elif name == "to-dcp":
        from pretrain.checkpoint.stream import convert

        convert(args[0], "dcp", args[1])
    elif (
        name == "to-dcp-mapped"
    ):  # before: DCP writes the mapped tensors themselves, their pages stay resident
        from pretrain.checkpoint.stream import open_source, write_dcp

        with open_source(args[0]) as source:
            source.loadable = set()
            write_dcp(source, args[1])
    elif (
        name == "hf-overhead"
    ):  # the imports of --to hf (the model's class too), the file's structure read (mapped)
        import transformers

        transformers.GPT2LMHeadModel  # noqa: B018 - transformers imports a model's module when it is first named

        from pretrain.checkpoint.io import read
        from pretrain.models.hf import save_hf_streamed  # noqa: F401

        read(args[0], mmap=True)
    elif name == "to-hf":
        from pathlib import Path

        from pretrain.finetuning.export import export_checkpoint

        export_checkpoint(Path(args[0]), args[1])
    elif name == "to-hf-whole":  # before: the model loaded whole, its transformers copy, save_pretrained
        from pretrain.checkpoint.convert import load_model
        from pretrain.models.hf import save_hf

        model, _, tokenizer = load_model(args[0])
        save_hf(model, args[1], tokenizer)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", help="directory for the checkpoints, kept (default: a temporary one)")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--file-of", help=argparse.SUPPRESS)
    parser.add_argument("--only-file", action="store_true", help="only the rows converting a checkpoint file")
    args, rest = parser.parse_known_args()
    if args.task:
        return task(args.task, rest)
    if args.rank_of:
        return write_rank(args.rank_of, int(rest[0]))
    if args.file_of:
        return write_file(args.file_of)
    with contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.only_file:
            sharded(work)
        from_file(work)
    return None


def table(rows: dict[str, dict], base: float, largest: float) -> None:
    print(f"{'':42} {'peak RSS MiB':>12} {'- overhead':>11} {'/ largest':>10} {'seconds':>8}")
    for label, row in rows.items():
        extra = row["peak_mib"] - base
        print(
            f"{label:42} {row['peak_mib']:>12.0f} {extra:>11.0f} {extra / largest:>10.2f} {row['seconds']:>8.1f}"
        )


def sharded(work: Path) -> None:
    """The rows converting the DCP directory written by 2 ranks."""
    for seed, name in ((1, "a"), (2, "b")):
        if (work / name / ".metadata").is_file():
            continue
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + seed), "WORLD_SIZE": "2"}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank-of", str(work / name), str(seed)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(2)
        ]
        assert all(p.wait() == 0 for p in procs)
    size = sum(f.stat().st_size for f in (work / "a").iterdir()) / 2**20
    largest = 50304 * 768 * 4 / 2**20
    rows = {
        "overhead (imports + metadata)": measure("overhead", str(work / "a")),
        "convert --to single (streaming)": measure("streaming", str(work / "a"), str(work / "s.ckpt")),
        "whole checkpoint in memory + torch.save": measure("whole", str(work / "a"), str(work / "w.ckpt")),
        "merge of 2 (streaming)": measure("merge", str(work / "a"), str(work / "b"), str(work / "m.ckpt")),
    }
    identical = filecmp.cmp(work / "s.ckpt", work / "w.ckpt", shallow=False)
    print(
        f"checkpoint: {size:.0f} MiB on disk (2 ranks), largest tensor {largest:.1f} MiB; load {os.getloadavg()}"
    )
    print(f"convert output byte-identical to the whole-checkpoint path: {identical}")
    table(rows, rows["overhead (imports + metadata)"]["peak_mib"], largest)


def from_file(work: Path) -> None:
    """The rows converting a checkpoint file: --to dcp (streamed, and before), --to hf."""
    import shutil

    file = work / "f.ckpt"
    if not file.is_file():
        subprocess.run([sys.executable, __file__, "--file-of", str(file)], check=True)
    for out in ("d", "d-mapped", "hf", "hf-whole"):
        shutil.rmtree(work / out, ignore_errors=True)
    largest = 50304 * 768 * 4 / 2**20
    rows = {
        "overhead (imports + file structure)": measure("file-overhead", str(file)),
        "convert --to dcp (copied, pages released)": measure("to-dcp", str(file), str(work / "d")),
        "convert --to dcp (mapped tensors, before)": measure(
            "to-dcp-mapped", str(file), str(work / "d-mapped")
        ),
    }
    hf = {
        "overhead (+ transformers, file structure)": measure("hf-overhead", str(file)),
        "convert --to hf (export, tensor by tensor)": measure("to-hf", str(file), str(work / "hf")),
        "the model whole, save_pretrained (before)": measure(
            "to-hf-whole", str(file), str(work / "hf-whole")
        ),
    }
    hf_names = sorted(p.name for p in (work / "hf-whole").iterdir())
    hf_identical = hf_names == sorted(p.name for p in (work / "hf").iterdir()) and all(
        filecmp.cmp(work / "hf" / n, work / "hf-whole" / n, shallow=False) for n in hf_names
    )
    names = sorted(p.name for p in (work / "d-mapped").iterdir())  # .metadata: a save's path and ids differ
    identical = names == sorted(p.name for p in (work / "d").iterdir()) and all(
        filecmp.cmp(work / "d" / n, work / "d-mapped" / n, shallow=False) for n in names if n != ".metadata"
    )
    print(
        f"checkpoint file: {file.stat().st_size / 2**20:.0f} MiB, largest tensor {largest:.1f} MiB; load {os.getloadavg()}"
    )
    print(f"--to dcp output byte-identical to the mapped-tensors path: {identical}")
    table(rows, rows["overhead (imports + file structure)"]["peak_mib"], largest)
    print(f"--to hf output byte-identical to the whole-model path: {hf_identical}")
    table(hf, hf["overhead (+ transformers, file structure)"]["peak_mib"], largest)


if __name__ == "__main__":
    main()
