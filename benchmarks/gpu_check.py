"""One-shot GPU check: bootstraps itself on a bare CUDA machine, runs each leg under its own timeout, keeps going
past a failed leg, prints a PASS/FAIL table, writes ``gpu_check.json`` to ``$OUT`` (or ``--out``) and exits 1 if
any leg failed.

    bash benchmarks/gpu_check.sh [--out DIR] [--legs data,train,...] [--wheels DIR]   # on the GPU machine
    bash benchmarks/gpu_check.sh --cpu                     # the same logic on a tiny model, on the CPU (CI)
    python benchmarks/gpu_check.py --fetch-wheels DIR      # here, with a registry: the wheels the machine lacks

Legs (GPU mode: GPT-2 124M shape on the shipped Tiny Shakespeare with a BPE trained here; CPU mode: 2 layers,
d=64):
- ``data``: ``pretrain tokenizer`` + ``pretrain prepare`` into the work directory.
- ``train``: bf16 + ``torch.compile``, ~100 measured steps after the compiling ones (throughput window);
  tokens/s and MFU from the run's metrics, loss finite and falling, no graph breaks and no recompiles (counted
  in the ``TORCH_LOGS=graph_breaks,recompiles`` log).
- ``resume-<strategy>`` (``ddp``/``fsdp``/``zero2``; CPU mode: ``single``): train N steps, resume to 2N from the
  step-N checkpoint, compare the final loss with an uninterrupted 2N-step run, consolidate the checkpoint to a
  Hugging Face directory (``pretrain export``) and check its logits equal ours (``load_model``).
- ``generation``: ``bench_generation.py``: tokens/s vs transformers' ``generate()``; greedy and beam outputs
  must be identical (the 1.2x target is reported, not enforced).
- ``float8``: the train leg's run without compile, bf16 against bf16 + ``trainer.float8=true`` (torchao, same
  seed and data): tokens/s ratio and final-loss difference (within 1 %). CPU mode: config validation must
  refuse float8 in one line.
- ``plan-ddp`` / ``plan-fsdp`` (GPU only): ``pretrain plan``'s per-GPU estimate for the strategy at the
  profile's micro-batch against ``torch.cuda.max_memory_allocated`` of a few real steps (within 15 %).

The train leg runs with ``trainer.sync_check=error`` (no host-device sync on a step that does not log) and
reports MFU with the tested dense peak of ``pretrain.training.callbacks.throughput`` (its FLOP convention and peak in
the result).

Bootstrap: the repository goes on ``PYTHONPATH`` of every child process; modules the machine lacks (omegaconf,
deepspeed, wandb, ...) are installed from ``--wheels`` (default ``benchmarks/wheels``, made by
``--fetch-wheels``) with ``pip install --no-index``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "recipes" / "data" / "tinyshakespeare.txt"
# importable module -> pip requirement carried as a wheel (their own dependencies are fetched alongside)
NEEDED = {"omegaconf": "omegaconf", "deepspeed": "deepspeed", "wandb": "wandb", "torchao": "torchao==0.18.0"}
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3", "deepspeed"]  # built into wheels here (pure Python), no deps
# binary wheels fetched with their dependencies (torch excluded: deepspeed's own ones are listed instead)
BINARY = ["omegaconf", "wandb", "pydantic", "hjson", "ninja", "py-cpuinfo", "msgpack", "nvidia-ml-py", "einops",
          "psutil", "tqdm", "torchao==0.18.0"]  # fmt: skip
STRATEGIES = {
    "single": [],
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "zero2": ["strategy.name=deepspeed", "strategy.deepspeed.stage=2", "trainer.compile=false"],
}
PROFILES = {
    "gpu": {
        "defaults": "[model/gpt2-124m, objective/clm, tokenizer/shakespeare-bpe, data/shakespeare, optim/gpt2, "
        "trainer/gpu, logger/default]",
        "model": {},
        "tokenizer_vocab": 8192,
        "corpus_bytes": None,  # all of it
        "seq_len": 1024,
        "micro_batch": 16,
        "train": {"steps": 130, "window": 100, "log_every": 10, "compile": True, "sync_check": "error"},
        "float8_steps": 60,
        "plan_steps": 4,
        "resume_steps": 10,
        "generation": ["--device", "cuda", "--size", "124m", "--rounds", "3", "--new-tokens", "64"],
        "loss_rtol": 2e-2,  # GPU kernels (atomics, flash backward) are not bitwise deterministic
        "timeouts": {"data": 300, "train": 900, "resume": 900, "generation": 900, "float8": 900, "plan": 600},
    },
    "cpu": {
        "defaults": "[model/gpt-tiny, objective/clm, tokenizer/shakespeare-bpe, data/shakespeare, optim/tiny, "
        "trainer/cpu, logger/default]",
        "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "d_ff": 128, "dropout": 0.0},
        "tokenizer_vocab": 1024,
        "corpus_bytes": 200_000,  # the first 200 kB of the corpus
        "seq_len": 64,
        "micro_batch": 8,
        "train": {"steps": 16, "window": 4, "log_every": 2, "compile": False, "sync_check": "error"},
        "float8_steps": 4,
        "plan_steps": 2,
        "resume_steps": 3,
        "generation": ["--device", "cpu", "--size", "tiny", "--rounds", "1", "--new-tokens", "4"],
        "loss_rtol": 1e-4,
        "timeouts": {"data": 120, "train": 120, "resume": 180, "generation": 120, "float8": 60, "plan": 300},
    },
}


# ---------------------------------------------------------------------------------------------- bootstrap
def child_env(site: Path | None = None) -> dict[str, str]:
    """The environment of every child: the repository (and installed wheels) on PYTHONPATH, W&B offline."""
    paths = [str(REPO), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "WANDB_MODE": "offline"}


def install_missing(wheels: Path) -> dict[str, str]:
    """``pip install --no-index --find-links wheels`` each module of NEEDED that does not import."""
    report = {}
    for module, requirement in NEEDED.items():
        if importlib.util.find_spec(module) is not None:
            report[module] = "present"
            continue
        if not wheels.is_dir():
            report[module] = f"missing (no wheel folder {wheels})"
            continue
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            requirement,
        ]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        report[module] = (
            "installed" if done.returncode == 0 else f"install failed: {done.stderr.strip()[-300:]}"
        )
    return report


def fetch_wheels(directory: Path) -> int:
    """Download (binary, CPython 3.12, manylinux x86_64, with dependencies) or build (pure-Python sdists) the
    carried wheels."""
    directory.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                              "manylinux_2_28_x86_64", "any")]  # fmt: skip
    pip = [sys.executable, "-m", "pip"]
    download = [*pip, "download", "--only-binary=:all:", "--python-version", "3.12", *platforms]
    status = 0
    for requirement in BINARY:
        status |= subprocess.run([*download, "-d", str(directory), requirement], check=False).returncode
    for requirement in SDIST_ONLY:
        build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(directory), requirement]
        status |= subprocess.run(build, check=False, env={**os.environ, "DS_BUILD_OPS": "0"}).returncode
    print(
        f"wheels in {directory}: {len(list(directory.glob('*.whl')))}; carry it and pass --wheels {directory}"
    )
    return status


# ---------------------------------------------------------------------------------------------- helpers
def write_recipe(work: Path, profile: dict, devices: int) -> Path:
    """A recipe composed of the shipped pieces, pointing its tokenizer and data into ``work``."""
    model = "".join(f"\n  {k}: {v}" for k, v in profile["model"].items())
    corpus = work / "corpus.txt"
    corpus.write_bytes(CORPUS.read_bytes()[: profile["corpus_bytes"]])
    recipe = work / "recipe.yaml"
    recipe.write_text(
        f"defaults: {profile['defaults']}\n"
        f"name: gpu-check\nseed: 1234\n"
        f"model:{model or ' {}'}\n"
        f"tokenizer:\n  path: {work / 'tokenizer.json'}\n  train_files: ['{corpus}']\n"
        f"  vocab_size: {profile['tokenizer_vocab']}\n  special_tokens: {{}}\n"
        f"data:\n  seq_len: {profile['seq_len']}\n  micro_batch_size: {profile['micro_batch']}\n"
        f"  sources:\n    - name: tinyshakespeare\n      text: ['{corpus}']\n      prepared: {work / 'data'}\n"
        f"trainer:\n  devices: {devices}\n  accumulate_grad_batches: 1\n  val_check_interval: 1000000\n"
        f"  limit_val_batches: 2\n  progress_bar: false\n"
        f"checkpoint:\n  save_top_k: 0\nlogger:\n  wandb:\n    enabled: false\n"
    )
    return recipe


def pretrain(args: list[str], processes: int = 1) -> None:
    """``pretrain ARGS`` in this process (one device), or as ``python -m pretrain`` (Lightning then starts one
    process per device); output goes to the leg's log. RuntimeError on failure."""
    print(f"\n$ pretrain {' '.join(args)}", flush=True)
    if processes > 1:
        code = subprocess.run([sys.executable, "-m", "pretrain", *args], check=False, cwd=REPO).returncode
    else:
        from pretrain.cli import main as cli

        code = cli(args)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        raise RuntimeError(f"pretrain {args[0]} exited with {code}")


def metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every logged metric of the run's newest launch: name -> {step: value}."""
    newest = max((run_dir / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    out: dict[str, dict[int, float]] = {}
    with open(newest / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None) and key != "step":
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def compile_events(log_text: str) -> dict[str, int]:
    """Graph breaks and recompilations in a log written with ``TORCH_LOGS=graph_breaks,recompiles``."""
    return {
        "graph_breaks": len(re.findall(r"Graph break in user code", log_text)),
        "recompiles": len(re.findall(r"Recompiling function", log_text)),
    }


def final_loss(run_dir: Path, step: int) -> float:
    """The training loss logged at optimizer step ``step`` (CSV rows count steps from 1, as checkpoint names)."""
    return metrics(run_dir)["train/loss"][step]


# ---------------------------------------------------------------------------------------------- legs
def leg_data(work: Path, profile: dict) -> dict:
    recipe = work / "recipe.yaml"
    pretrain(["tokenizer", str(recipe)])
    pretrain(["prepare", str(recipe)])
    return {"tokenizer": str(work / "tokenizer.json"), "data": str(work / "data")}


def leg_train(work: Path, profile: dict, log: Path) -> dict:
    t = profile["train"]
    run_dir = work / "train"
    overrides = [f"run_dir={run_dir}", "resume=null", f"trainer.max_steps={t['steps']}",
                 f"trainer.throughput_window={t['window']}", f"trainer.log_every_n_steps={t['log_every']}",
                 f"trainer.compile={str(t['compile']).lower()}", f"checkpoint.every_n_steps={t['steps']}",
                 "optim.warmup_steps=5", f"trainer.sync_check={t['sync_check']}"]  # fmt: skip
    start = log.stat().st_size  # the parent started this leg with TORCH_LOGS=graph_breaks,recompiles
    pretrain(["fit", str(work / "recipe.yaml"), *overrides], profile["devices"])
    m = metrics(run_dir)
    losses = [m["train/loss"][s] for s in sorted(m["train/loss"])]
    events = compile_events(log.read_text()[start:])
    last = max(m["train/tokens_per_sec_per_device"])
    result = {
        "steps": t["steps"],
        "compiled": t["compile"],
        "measured_steps": t["window"],
        "tokens_per_s_per_device": m["train/tokens_per_sec_per_device"][last],
        "mfu": m.get("train/mfu", {}).get(last),
        **peak_used(),
        "sync_check": t["sync_check"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        **events,
    }
    problems = []
    if not all(math.isfinite(x) for x in losses):
        problems.append("loss not finite")
    if not losses[-1] < losses[0]:
        problems.append(f"loss not falling ({losses[0]:.3f} -> {losses[-1]:.3f})")
    if events["graph_breaks"] or events["recompiles"]:
        problems.append(f"{events['graph_breaks']} graph breaks, {events['recompiles']} recompiles")
    if problems:
        raise AssertionError("; ".join(problems) + f" | {result}")
    return result


def peak_used() -> dict:
    """The device, the dense bf16 peak MFU divides by (the tested table) and the FLOP convention."""
    import torch

    from pretrain.training.callbacks.throughput import MFU_CONVENTION, peak_for

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device_name": name, "peak_bf16_flops": peak_for(name, "bf16"), "mfu_convention": MFU_CONVENTION}


def leg_float8(work: Path, profile: dict) -> dict:
    """bf16 vs bf16 + float8, same seed and data, eager: tokens/s and the final loss (GPU); the refusal (CPU)."""
    recipe = work / "recipe.yaml"
    if profile.get("cpu"):
        from pretrain import config

        try:
            config.load(recipe, ["trainer.float8=true"])
        except ValueError as err:
            message = str(err)
            if "needs CUDA GPUs" not in message or "\n" in message:
                raise AssertionError(f"float8 refused with an unclear message: {message!r}") from None
            return {"refused_on_cpu": message}
        raise AssertionError("trainer.float8=true was accepted on the CPU")
    n = profile["float8_steps"]
    out = {}
    for name, extra in (("bf16", []), ("float8", ["trainer.float8=true"])):
        run_dir = work / f"float8-{name}"
        pretrain(["fit", str(recipe), f"run_dir={run_dir}", "resume=null", f"trainer.max_steps={n}",
                  "trainer.compile=false", f"trainer.throughput_window={n // 2}", "trainer.log_every_n_steps=5",
                  f"checkpoint.every_n_steps={n}", *extra], profile["devices"])  # fmt: skip
        m = metrics(run_dir)
        last = max(m["train/tokens_per_sec_per_device"])
        out[name] = {
            "tokens_per_s": m["train/tokens_per_sec_per_device"][last],
            "loss": final_loss(run_dir, n),
        }
    result = {
        "tokens_per_s_ratio": out["float8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"],
        "loss_bf16": out["bf16"]["loss"],
        "loss_float8": out["float8"]["loss"],
        "loss_rel_diff": abs(out["float8"]["loss"] - out["bf16"]["loss"]) / out["bf16"]["loss"],
    }
    if result["loss_rel_diff"] > 0.01:
        raise AssertionError(f"float8 loss differs from bf16's by more than 1 % | {result}")
    return result


def leg_plan(work: Path, profile: dict, strategy: str) -> dict:
    """``pretrain plan``'s per-GPU total for ``strategy`` against ``torch.cuda.max_memory_allocated`` of a few
    real steps of the same recipe (eager; rank 0's peak)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from pretrain import config
    from pretrain.training import plan
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    n = profile["plan_steps"]
    overrides = [f"strategy.name={strategy}", f"run_dir={work / f'plan-{strategy}'}", "resume=null",
                 f"trainer.max_steps={n}", "trainer.compile=false", "checkpoint.save_top_k=0",
                 f"checkpoint.every_n_steps={10 * n}", "guards.nonfinite.enabled=false"]  # fmt: skip
    run, resolved = config.load(work / "recipe.yaml", overrides)
    traces = plan.traces(run, run.data.micro_batch_size, False, profile["devices"])
    estimate = plan.per_gpu(traces, strategy, profile["devices"], run)

    class Peak(Callback):
        value = 0

        def on_train_start(self, trainer, pl_module):
            torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module):
            Peak.value = torch.cuda.max_memory_allocated()

    parts = prepare_run(run, resolved)
    trainer = build_trainer(run, resolved, callbacks=[Peak()])
    trainer.fit(parts.module, datamodule=parts.datamodule)
    if trainer.global_rank != 0:
        sys.exit(0)  # a rank Lightning started: rank 0 reports
    result = {"strategy": strategy, "gpus": profile["devices"], "estimate_bytes": estimate["total"],
              "measured_bytes": Peak.value, "ratio": estimate["total"] / max(1, Peak.value),
              "estimate_parts": estimate}  # fmt: skip
    if not 0.85 <= result["ratio"] <= 1.15:
        raise AssertionError(f"plan is off by more than 15 % | {result}")
    return result


def leg_resume(work: Path, profile: dict, strategy: str) -> dict:
    import torch

    n = profile["resume_steps"]
    recipe = str(work / "recipe.yaml")
    common = [*STRATEGIES[strategy], "trainer.log_every_n_steps=1", "trainer.compile=false", "optim.warmup_steps=2",
              f"trainer.max_steps={2 * n}", f"trainer.val_check_interval={n}", f"checkpoint.every_n_steps={n}",
              "checkpoint.save_top_k=2"]  # fmt: skip
    devices = profile["devices"]
    straight, resumed = work / f"straight-{strategy}", work / f"resume-{strategy}"
    pretrain(["fit", recipe, f"run_dir={straight}", "resume=null", *common], devices)
    # the step-N checkpoint of the uninterrupted run (kept as one of the best two by validation loss)
    (mid,) = (straight / "checkpoints").glob(f"best-step{n}-*")
    pretrain(["fit", recipe, f"run_dir={resumed}", f"resume={mid}", *common], devices)
    loss_resumed, loss_straight = final_loss(resumed, 2 * n), final_loss(straight, 2 * n)
    first_resumed_step = min(metrics(resumed)["train/loss"])
    checkpoint = resumed / "checkpoints" / "last.ckpt"
    hf_dir = resumed / "hf"
    pretrain(["export", str(checkpoint), str(hf_dir)])

    import transformers

    from pretrain.checkpoint import load_model

    ours, _, _ = load_model(checkpoint)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    with torch.no_grad():
        diff = (ours.to(device)(ids).logits - theirs.to(device)(ids).logits).abs().max().item()
    result = {
        "strategy": strategy,
        "resumed_at_step": first_resumed_step,
        "loss_resumed": loss_resumed,
        "loss_uninterrupted": loss_straight,
        "hf_max_abs_logit_diff": diff,
    }
    problems = []
    if first_resumed_step != n + 1:
        problems.append(f"the second launch started at step {first_resumed_step}, not {n + 1}")
    if not math.isclose(loss_resumed, loss_straight, rel_tol=profile["loss_rtol"]):
        problems.append(f"resumed loss {loss_resumed:.6f} != uninterrupted {loss_straight:.6f}")
    if not diff < 1e-3:
        problems.append(f"Hugging Face logits differ from ours by {diff:.2e}")
    if problems:
        raise AssertionError("; ".join(problems) + f" | {result}")
    return result


def leg_generation(work: Path, profile: dict) -> dict:
    import runpy

    out = work / "generation.json"
    script = REPO / "benchmarks" / "bench_generation.py"
    sys.argv = [str(script), *profile["generation"], "--json", str(out)]
    runpy.run_path(str(script), run_name="__main__")
    rows = json.loads(out.read_text())["results"]
    ratios = {f"{r['model']} b{r['batch']} {r['mode']}": round(r["ratio"], 3) for r in rows}
    result = {
        "ratios": ratios,
        "min_ratio": min(ratios.values()),
        "target_1.2x_met": min(ratios.values()) >= 1.2,
    }
    different = [
        f"{r['model']} b{r['batch']} {r['mode']}"
        for r in rows
        if r["mode"] != "sample" and not r["identical"]
    ]
    if different:
        raise AssertionError(f"outputs differ from transformers' generate() in {different}")
    return result


def run_leg(name: str, work: Path, profile: dict, log: Path) -> dict:
    if name == "data":
        return leg_data(work, profile)
    if name == "train":
        return leg_train(work, profile, log)
    if name == "generation":
        return leg_generation(work, profile)
    if name == "float8":
        return leg_float8(work, profile)
    if name in ("plan-ddp", "plan-fsdp"):
        return leg_plan(work, profile, name[len("plan-") :])
    if name.startswith("resume-") and name[len("resume-") :] in STRATEGIES:
        return leg_resume(work, profile, name[len("resume-") :])
    raise ValueError(f"unknown leg {name!r}")


# ---------------------------------------------------------------------------------------------- driver
def launch(name: str, args: argparse.Namespace, work: Path, env: dict[str, str], timeout: float) -> dict:
    """Run one leg in its own process group under ``timeout``; its result (or error) comes back as JSON."""
    result_file, log = work / f"{name}.result.json", work / f"{name}.log"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--leg", name, "--work", str(work), *(["--cpu"] if args.cpu else [])]
    if name == "train":
        env = {**env, "TORCH_LOGS": "graph_breaks,recompiles"}
    start = time.perf_counter()
    with open(log, "a") as out:
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the leg and everything it started (ranks, compilers)
            child.wait()
    seconds = round(time.perf_counter() - start, 1)
    if result_file.is_file():
        return {**json.loads(result_file.read_text()), "seconds": seconds}
    reason = (
        f"timed out after {timeout:.0f} s"
        if child.returncode == -signal.SIGKILL
        else f"exit {child.returncode}"
    )
    return {"status": "FAIL", "error": f"{reason}; see {log}", "seconds": seconds}


def default_legs(cpu: bool, devices: int) -> list[str]:
    if cpu:
        return ["data", "train", "resume-single", "generation", "float8"]
    return ["data", "train", "resume-ddp" if devices > 1 else "resume-single", "resume-fsdp", "resume-zero2",
            "generation", "float8", "plan-ddp", "plan-fsdp"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU (the CI mode)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_check"))
    parser.add_argument("--legs", default=None, help="comma-separated legs (default: all of the mode)")
    parser.add_argument("--wheels", default=str(REPO / "benchmarks" / "wheels"))
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every leg's timeout")
    parser.add_argument("--fetch-wheels", metavar="DIR", default=None)
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # internal: run one leg in this process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels))
    profile = PROFILES["cpu" if args.cpu else "gpu"]
    if args.leg:  # child: one leg, its result written next to its log
        import torch

        work = Path(args.work)
        profile = {**profile, "devices": 1 if args.cpu else torch.cuda.device_count(), "cpu": args.cpu}
        try:
            result = {"status": "PASS", **run_leg(args.leg, work, profile, work / f"{args.leg}.log")}
        except Exception as err:  # noqa: BLE001 (any failure of a leg is its FAIL row, the next leg still runs)
            traceback.print_exc()
            result = {"status": "FAIL", "error": f"{type(err).__name__}: {err}"}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # ranks Lightning started run the leg too
            (work / f"{args.leg}.result.json").write_text(json.dumps(result, indent=1))
        return 0 if result["status"] == "PASS" else 1

    import torch

    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --cpu for the CPU mode")
        return 2
    devices = 1 if args.cpu else torch.cuda.device_count()
    bootstrap = install_missing(Path(args.wheels))
    env = child_env()
    write_recipe(work, profile, devices)
    legs = args.legs.split(",") if args.legs else default_legs(args.cpu, devices)
    device = "cpu" if args.cpu else f"{devices} x {torch.cuda.get_device_name()}"
    print(
        f"gpu_check ({'cpu' if args.cpu else 'gpu'} mode) on {device}; torch {torch.__version__}; work {work}"
    )
    print(f"bootstrap: {bootstrap}")
    results = {}
    for name in legs:
        timeout = profile["timeouts"][name.split("-")[0]] * args.timeout_scale
        if name != "data" and results.get("data", {}).get("status") == "FAIL":
            results[name] = {"status": "FAIL", "error": "the data leg failed", "seconds": 0.0}
        else:
            results[name] = launch(name, args, work, env, timeout)
        print(f"  {name:<16}{results[name]['status']}  ({results[name]['seconds']} s)", flush=True)

    print(f"\n{'leg':<16}{'result':<8}{'seconds':>8}  details")
    for name, r in results.items():
        details = r.get("error") or {k: v for k, v in r.items() if k not in ("status", "seconds")}
        print(f"{name:<16}{r['status']:<8}{r['seconds']:>8}  {details}")
    report = {"mode": "cpu" if args.cpu else "gpu", "device": device, "torch": torch.__version__,
              "bootstrap": bootstrap, "legs": results}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'gpu_check.json'}")
    return 0 if all(r["status"] == "PASS" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
