"""Multi-node, simulated for real on one machine: 2 nodes x 1 process through ``torchrun`` (two launchers,
static rendezvous on 127.0.0.1) and through ``recipes/slurm.sbatch`` with a stand-in ``srun`` that starts the
tasks with the environment SLURM gives them. Right global ranks and data shards: the losses equal one process
with twice the micro-batch. Checkpoint ownership: each "node" runs in its own directory and only global rank 0
writes anything (checkpoints, logs)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from training_utils import (
    REPO_ROOT,
    cli_command,
    cli_env,
    metric_by_step,
    read_metrics,
    run_cli,
    tiny_recipe,
)

STEPS = 6
FAKE_SRUN = """#!{python}
# Stand-in for srun: every task of the job's nodes, with the variables srun sets, node n in directory node<n>.
import os, subprocess, sys
args = [a for a in sys.argv[1:] if not a.startswith("--")]
nodes, per_node = int(os.environ["SLURM_JOB_NUM_NODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(node), SLURM_NTASKS=str(nodes * per_node), SLURM_NNODES=str(nodes),
                   SLURM_NODELIST="127.0.0.1", SLURM_STEP_ID="0")
        tasks.append(subprocess.Popen(args, env=env, cwd=f"node{{node}}"))
sys.exit(max(task.wait() for task in tasks))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe(directory: Path, world, micro_batch_size: int, num_nodes: int = 1, **sections) -> Path:
    directory.mkdir(parents=True)
    return tiny_recipe(
        directory,
        world,
        "gpt",
        run_dir="run",  # relative: each node writes under its own working directory
        data={"micro_batch_size": micro_batch_size},
        trainer={"max_steps": STEPS, "val_check_interval": 3, "num_nodes": num_nodes, "devices": 1},
        checkpoint={"every_n_steps": 3, "save_top_k": 0},
        **sections,
    )


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory, tiny_world) -> dict[int, float]:
    directory = tmp_path_factory.mktemp("one")
    run_cli("fit", str(recipe(directory / "r", tiny_world, 4)), cwd=directory)
    return metric_by_step(read_metrics(directory / "run"), "train/loss")


def two_nodes(tmp_path: Path, world) -> Path:
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    return recipe(
        tmp_path / "recipe",
        world,
        2,
        num_nodes=2,
        strategy={"name": "ddp", "ddp": {"process_group_backend": "gloo"}},
    )


def check(tmp_path: Path, outputs: list[str], reference: dict[int, float]) -> None:
    assert (tmp_path / "node0/run/checkpoints/last.ckpt").is_file(), outputs
    assert not [p for p in (tmp_path / "node1").rglob("*") if p.is_file()]  # global rank 1 wrote no file
    losses = metric_by_step(read_metrics(tmp_path / "node0/run"), "train/loss")
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)


@pytest.mark.slow
def test_torchrun_two_nodes_match_one_process(tmp_path, tiny_world, one_process_losses):
    path, port = two_nodes(tmp_path, tiny_world), free_port()
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
            + [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
            + cli_command("fit", str(path))[1:],
            cwd=tmp_path / f"node{node}",
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs
    check(tmp_path, outputs, one_process_losses)


@pytest.mark.slow
@pytest.mark.heavy
def test_slurm_sbatch_two_nodes_match_one_process(tmp_path, tiny_world, one_process_losses):
    path = two_nodes(tmp_path, tiny_world)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    env = cli_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{cli_env()['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="pretrain",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        MASTER_PORT=str(free_port()),
    )
    done = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "recipes/slurm.sbatch"),
            str(path),
            "strategy.ddp.process_group_backend=gloo",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    check(tmp_path, [done.stdout + done.stderr], one_process_losses)
