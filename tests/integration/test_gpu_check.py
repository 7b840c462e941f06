"""benchmarks/gpu_check.py in its CPU mode (a tiny model): every leg passes and lands in the table and the JSON; a
failing or hanging leg is reported and the rest still run; graph breaks and recompiles are counted in real logs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.heavy  # make test-all


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(out)}
    return subprocess.run(
        ["bash", str(SCRIPT), "--cpu", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_cpu_mode_passes_every_leg_and_writes_the_table_and_json(tmp_path):
    done = gpu_check(tmp_path, "--timeout-scale", "3")  # slack for a loaded CI machine
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    legs = report["legs"]
    assert list(legs) == ["data", "train", "resume-single", "generation", "float8"]
    assert all(leg["status"] == "PASS" for leg in legs.values())
    assert all(f"{name:<16}PASS" in done.stdout for name in legs)  # the table
    train = legs["train"]
    assert train["last_loss"] < train["first_loss"] and train["tokens_per_s_per_device"] > 0
    assert train["graph_breaks"] == train["recompiles"] == 0
    assert train["sync_check"] == "error" and train["peak_bf16_flops"] is None  # a CPU has no peak: no MFU
    assert train["mfu"] is None and "no causal halving" in train["mfu_convention"]
    assert "needs CUDA GPUs" in legs["float8"]["refused_on_cpu"]
    resume = legs["resume-single"]
    assert resume["resumed_at_step"] == 4 and resume["loss_resumed"] == resume["loss_uninterrupted"]
    assert resume["hf_max_abs_logit_diff"] < 1e-3
    assert {"gpt2 b8 beam", "t5 b1 greedy"} <= set(legs["generation"]["ratios"])


def test_failed_and_timed_out_legs_are_reported_and_the_rest_still_run(tmp_path):
    # the train leg gets its tokenizer and data first, so it is still starting (not refusing in a second a run
    # with no tokenizer) when its 2.4 s are up
    assert gpu_check(tmp_path, "--legs", "data", "--timeout-scale", "3").returncode == 0
    done = gpu_check(tmp_path, "--legs", "resume-nosuch,train", "--timeout-scale", "0.02")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 1
    assert [leg["status"] for leg in report["legs"].values()] == ["FAIL", "FAIL"]
    assert "timed out" in report["legs"]["train"]["error"]  # 2.4 s: killed with its process group


def test_compile_events_are_counted_in_a_real_torch_logs_output(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    program = tmp_path / "compiled.py"
    program.write_text(
        "import torch\n"
        "@torch.compile(backend='eager')\n"
        "def f(x):\n    y = x * 2\n    print('break')\n    return y + 1\n"
        "f(torch.ones(2)); f(torch.ones(3))\n"  # a graph break, then a recompile for the new shape
    )
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    log = subprocess.run(
        [sys.executable, str(program)], env=env, check=False, capture_output=True, text=True, timeout=300
    )
    events = module.compile_events(log.stderr)
    assert events["graph_breaks"] >= 1 and events["recompiles"] >= 1, log.stderr[-2000:]
    assert module.compile_events(log.stdout) == {"graph_breaks": 0, "recompiles": 0}  # 'break' twice
