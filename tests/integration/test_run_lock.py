"""One writer per run directory (issue 32): `pretrain fit`, `finetune`, `baseline` and `export` refuse a directory
another process is writing, in one line naming its pid and host; the lock of a process that was killed is taken
over by the next run (the kernel drops it), as a SLURM requeue or a torchrun restart needs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from training_utils import REPO_ROOT, one_error_line, tiny_recipe

from pretrain.cli import main
from pretrain.io import exclusive, lock_path

HOLDER = f"pid {os.getpid()} on host {socket.gethostname()}"


def test_a_second_writer_is_refused_naming_the_first(capsys, tmp_path, tiny_world, tiny_gpt_run):
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer={"max_steps": 2, "val_check_interval": 2})
    with exclusive(tmp_path / "run", "`pretrain fit`"):  # what a running `pretrain fit` holds
        line = one_error_line(capsys, "fit", recipe)
        assert f"another `pretrain fit` ({HOLDER}, `pretrain fit` since" in line and "is writing" in line
        # before: the second resumed from the first's in-flight last.ckpt, and both wrote it
        assert not (tmp_path / "run" / "checkpoints").exists()
        finetune = ["recipes/finetune-sst2-minilm.yaml", f"run_dir={tmp_path / 'run'}"]
        assert HOLDER in one_error_line(capsys, "finetune", *finetune)
        baseline = ["recipes/lstm-lm-tiny.yaml", f"run_dir={tmp_path / 'run'}"]
        assert HOLDER in one_error_line(capsys, "baseline", *baseline)
    with exclusive(tmp_path / "hf", "`pretrain export`"):
        assert HOLDER in one_error_line(capsys, "export", tiny_gpt_run["ckpt"], tmp_path / "hf")


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, tiny_world):
    hold = (
        "import sys, time; from pretrain.io import exclusive\n"
        "with exclusive(sys.argv[1], 'a killed run'):\n    print('held', flush=True); time.sleep(600)"
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, str(run_dir)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    assert f'"pid": {proc.pid}' in lock_path(run_dir).read_text()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer={"max_steps": 2, "val_check_interval": 2})
    assert main(["fit", str(recipe)]) == 0
    assert not lock_path(run_dir).exists()  # released: nothing left beside the run directory
