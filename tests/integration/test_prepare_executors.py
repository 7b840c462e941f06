"""`pretrain prepare --executor` (datatrove): 2 local tasks and a 2-worker local Ray cluster give, document by
document, the tokens and train/val split of single-process prepare, and the datamodule reads the shards as one
source; a failed task leaves no shard a run could read, and the rerun redoes only that task. One large file split
in byte ranges over 2-3 tasks, and exact dedup across 2 tasks, give single-process prepare's output too."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from training_utils import CORPUS, run_cli, tiny_recipe

from pretrain.datamodules.executors import prepare_in_tasks
from pretrain.datamodules.indexed import IndexedDataset
from pretrain.datamodules.prepare import prepare, split_prefixes
from pretrain.datamodules.pretrain import PretrainDataModule


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three files, ~300 KB: tasks split them 2 + 1."""
    root = tmp_path_factory.mktemp("exec")
    text = CORPUS.read_text()
    files = []
    for i, (lo, hi) in enumerate([(0, 120_000), (120_000, 240_000), (240_000, 300_000)]):
        files.append(root / f"part{i}.txt")
        files[-1].write_text(text[lo:hi])
    return files


def documents(directory, split: str) -> list[list[int]]:
    return [d.tolist() for p in split_prefixes(directory, split) for d in IndexedDataset(p)]


def assert_same_corpus(single, tasks) -> None:
    for split in ("train", "val"):
        assert documents(tasks, split) == documents(single, split)
        joined = b"".join(Path(f"{p}.bin").read_bytes() for p in split_prefixes(tasks, split))
        assert joined == (single / f"{split}.bin").read_bytes()
    one, many = (json.loads((d / "meta.json").read_text()) for d in (single, tasks))
    assert {k: v for k, v in many.items() if k != "shards"} == one  # cache key, counts, inputs, warnings


def test_one_file_in_byte_ranges_over_tasks_equals_single_process(tmp_path, tiny_world):
    """Each convention that allows byte ranges: the file is cut inside (no task is empty), and the shards hold,
    document by document, single-process prepare's tokens and train/val split."""
    tok = tiny_world["tokenizer"]
    paragraphs = CORPUS.read_text()[:150_000].split("\n\n")
    text = tmp_path / "big.txt"
    text.write_text("\n\n\n".join(paragraphs))
    records = tmp_path / "big.jsonl"
    records.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    for path, document, tasks in [(text, "blank_line", 3), (text, "line", 2), (records, "blank_line", 2)]:
        single, many = tmp_path / f"one-{path.suffix}-{document}", tmp_path / f"many-{path.suffix}-{document}"
        settings = {"val_fraction": 0.2, "seed": 7, "document": document}
        prepare(path, tok, single, progress=False, **settings)
        prepare_in_tasks(path, tok, many, tasks=tasks, workers=1, **settings)
        assert all(len(IndexedDataset(p)) > 0 for p in split_prefixes(many, "train"))
        assert len(split_prefixes(many, "train")) == tasks
        assert_same_corpus(single, many)
    # invalid UTF-8 in a piece that starts inside the file (found by the scan, or by the tokenizing task after it):
    # the same message, naming the line in the whole file, as single-process prepare
    good = text.read_bytes()
    for where in (len(good) // 2, 5 * len(good) // 6):
        cut = good.index(b"\n", where) + 1
        text.write_bytes(good[:cut] + b"\xff\n" + good[cut:])
        with pytest.raises(ValueError) as single_error:
            prepare(text, tok, tmp_path / "bad-one", progress=False)
        with pytest.raises(ValueError) as tasks_error:
            prepare_in_tasks(text, tok, tmp_path / f"bad-many-{where}", tasks=3, workers=1)
        assert str(tasks_error.value).startswith(str(single_error.value).split(";")[0])


def test_exact_dedup_across_two_tasks_keeps_the_first_in_stream_order(capsys, tmp_path, tiny_world):
    """Repeats in task 1 of documents in task 0 (and within each task) are dropped as single-process prepare
    drops them; the counts reach meta.json and the CLI summary."""
    from pretrain.cli import main

    paragraphs = CORPUS.read_text()[:60_000].split("\n\n")
    parts = [paragraphs[:200] + paragraphs[20:30], paragraphs[200:] + paragraphs[:50] + paragraphs[210:215]]
    files = []
    for i, part in enumerate(parts):
        files.append(tmp_path / f"part{i}.txt")
        files[-1].write_text("\n\n".join(part))
    tok = tiny_world["tokenizer"]
    settings = {"val_fraction": 0.3, "dedup": "exact"}
    single = prepare(files, tok, tmp_path / "single", progress=False, **settings)
    many = prepare_in_tasks(files, tok, tmp_path / "tasks", tasks=2, workers=1, **settings)
    assert single["duplicates_dropped"] >= 65 and many["duplicates_dropped"] == single["duplicates_dropped"]
    assert_same_corpus(tmp_path / "single", tmp_path / "tasks")

    data = {"sources": [{"name": "d", "text": [str(f) for f in files], "prepared": str(tmp_path / "cli")}]}
    data["sources"][0]["dedup"] = "exact"
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data={**data, "val_fraction": 0.3})
    assert main(["prepare", str(recipe), "--executor", "local", "--tasks", "2", "--workers", "1"]) == 0
    assert f"dropped {single['duplicates_dropped']} exact duplicates" in capsys.readouterr().out
    assert_same_corpus(tmp_path / "single", tmp_path / "cli")


def test_local_tasks_equal_single_process_and_rerun_only_the_failed_one(tmp_path, corpus, tiny_world):
    tok = tiny_world["tokenizer"]
    single = tmp_path / "single"
    prepare(corpus, tok, single, val_fraction=0.2, seed=3, progress=False)

    good = corpus[2].read_bytes()
    broken = tmp_path / "in" / "part2.txt"  # task 1's file fails half-way (invalid UTF-8)
    broken.parent.mkdir()
    inputs = [*corpus[:2], broken]
    broken.write_bytes(good[:30_000] + b"\n\xff\n" + good[30_000:])
    out = tmp_path / "tasks"
    with pytest.raises(ValueError, match=r"part2.txt:\d+: invalid UTF-8"):
        prepare_in_tasks(inputs, tok, out, tasks=2, workers=1, val_fraction=0.2, seed=3)  # task 0, then 1
    assert not out.exists()  # nothing a run could read
    (staging,) = tmp_path.glob(".tasks.tasks-*")
    assert sorted(p.name for p in staging.glob("*-00000.*")) == [
        "spec-00000.json",
        "task-00000.json",
        "train-00000.bin",
        "train-00000.idx",
        "val-00000.bin",
        "val-00000.idx",
    ]
    done = (staging / "train-00000.bin").stat().st_ino

    broken.write_bytes(good)  # fixed: the rerun redoes task 1 only
    meta = prepare_in_tasks(inputs, tok, out, tasks=2, val_fraction=0.2, seed=3)
    assert (out / "train-00000.bin").stat().st_ino == done  # task 0's shard, moved in, not rewritten
    assert meta["shards"] == ["00000", "00001"] and not staging.exists()
    single_here = tmp_path / "single-here"  # the same files at the same paths, single process
    prepare(inputs, tok, single_here, val_fraction=0.2, seed=3, progress=False)
    assert_same_corpus(single_here, out)
    assert prepare_in_tasks(inputs, tok, out, tasks=2, val_fraction=0.2, seed=3)["cache_hit"]

    # the datamodule reads the shards as one source: the same batches as from the single-process directory
    class Causal:
        def raw_length(self, n):
            return n + 1

        def __call__(self, tokens, generators):
            return {"input_ids": tokens}

    batches = []
    for directory in (single_here, out):
        dm = PretrainDataModule(directory, Causal(), seq_len=63, micro_batch_size=4, seed=5)
        dm.setup("fit")
        batches.append([b["input_ids"] for b, _ in zip(dm.train_dataloader(), range(6))])
    assert all(np.array_equal(a, b) for a, b in zip(*batches, strict=True))
    # and so do the baselines (LSTM, word vectors): the single-process token stream
    from pretrain.baselines.data import split_tokens

    for split in ("train", "val"):
        expected = np.asarray(IndexedDataset(single_here / split).tokens, dtype=np.int64)
        assert np.array_equal(split_tokens([out], split), expected)


@pytest.mark.slow
@pytest.mark.heavy  # the task/assembly logic is the local executor's (tested); this adds Ray's scheduling
def test_ray_cluster_of_two_workers_equals_single_process(tmp_path, corpus, tiny_world):
    single = tmp_path / "single"
    prepare(corpus, tiny_world["tokenizer"], single, val_fraction=0.1, progress=False)
    data = {
        "sources": [{"name": "c", "text": [str(f) for f in corpus], "prepared": str(tmp_path / "ray")}],
        "val_fraction": 0.1,
    }
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data=data)
    out = run_cli("prepare", str(recipe), "--executor", "ray", "--tasks", "2", "--workers", "2")
    assert "prepared c ->" in out.stdout
    assert_same_corpus(single, tmp_path / "ray")


# ------------------------------------------------------------------ a failure never destroys finished work (issue 32)
def _fail_task_1(tmp_path, corpus, name: str) -> tuple[list[Path], Path, bytes]:
    """Inputs whose task 1 fails half-way (invalid UTF-8): task 0 finishes, its shards wait in staging."""
    good = corpus[2].read_bytes()
    broken = tmp_path / name / "part2.txt"
    broken.parent.mkdir()
    broken.write_bytes(good[:30_000] + b"\n\xff\n" + good[30_000:])
    return [*corpus[:2], broken], broken, good


def test_a_lost_or_damaged_shard_of_a_finished_task_is_redone_and_an_assembly_failure_loses_nothing(
    tmp_path, corpus, tiny_world, monkeypatch
):
    tok, settings = tiny_world["tokenizer"], {"val_fraction": 0.2, "seed": 3}
    inputs, broken, good = _fail_task_1(tmp_path, corpus, "in")
    single = tmp_path / "single"
    out = tmp_path / "tasks"
    with pytest.raises(ValueError, match="invalid UTF-8"):
        prepare_in_tasks(inputs, tok, out, tasks=2, workers=1, **settings)
    (staging,) = tmp_path.glob(".tasks.tasks-*")
    broken.write_bytes(good)
    prepare(inputs, tok, single, progress=False, **settings)

    # the assembly fails after moving shards (a full disk writing meta.json): every shard goes back to staging
    from pretrain.datamodules import executors

    real_write = executors.atomic_write_text

    def full_disk(path, text):
        if Path(path).name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, text)

    monkeypatch.setattr(executors, "atomic_write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare_in_tasks(inputs, tok, out, tasks=2, workers=1, **settings)
    shards = sorted(p.name for p in staging.glob("*-0000?.*") if p.suffix in (".bin", ".idx"))
    assert len(shards) == 8 and not out.exists()  # train/val x bin/idx x 2 tasks, all kept
    monkeypatch.setattr(executors, "atomic_write_text", real_write)

    # a finished task's shard lost (val idx) and another's truncated by whole tokens: both tasks run again
    (staging / "val-00000.idx").unlink()
    with open(staging / "train-00001.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 20)
    with pytest.warns(UserWarning, match="shards are damaged"):
        prepare_in_tasks(inputs, tok, out, tasks=2, workers=1, **settings)
    assert_same_corpus(single, out)
    assert not staging.exists()


def test_bad_task_counts_are_refused_and_an_earlier_counts_staging_is_removed(
    capsys, tmp_path, corpus, tiny_world
):
    from training_utils import one_error_line

    data = {"sources": [{"name": "c", "text": [str(corpus[2])], "prepared": str(tmp_path / "zero")}]}
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data=data)  # --tasks 0 used to prepare it in 1 task
    assert "--tasks must be >= 1" in one_error_line(
        capsys, "prepare", recipe, "--executor", "local", "--tasks", 0
    )
    assert "--workers must be >= 0" in one_error_line(capsys, "prepare", recipe, "--workers", -2)

    tok, settings = tiny_world["tokenizer"], {"val_fraction": 0.2}
    inputs, broken, good = _fail_task_1(tmp_path, corpus, "in")
    out = tmp_path / "tasks"
    with pytest.raises(ValueError, match="invalid UTF-8"):
        prepare_in_tasks(inputs, tok, out, tasks=2, workers=1, **settings)
    (two,) = tmp_path.glob(".tasks.tasks-*")
    broken.write_bytes(good)
    with pytest.warns(UserWarning, match="an earlier `pretrain prepare --executor` with another --tasks"):
        prepare_in_tasks(inputs, tok, out, tasks=3, workers=1, **settings)
    assert not two.exists() and not list(tmp_path.glob(".tasks.*"))


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are gone already
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads sessions from /proc")
def test_a_killed_launcher_takes_its_workers_with_it(tmp_path, tiny_world):
    """SIGKILL of `pretrain prepare --executor local` while its 2 workers tokenize: within seconds no process of
    it is left (datatrove's workers, its fork server and manager used to run on for minutes)."""
    import signal
    import subprocess
    import time

    from training_utils import cli_command, cli_env

    big = tmp_path / "big.txt"
    big.write_text(CORPUS.read_text() * 6)
    data = {
        "sources": [{"name": "big", "text": [str(big)], "prepared": str(tmp_path / "p"), "document": "line"}]
    }
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data=data)
    launcher = subprocess.Popen(
        cli_command("prepare", str(recipe), "--executor", "local", "--tasks", "2", "--workers", "2"),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    left: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob(".p.tasks-*/partial-*")):  # the workers are writing their shards
            assert launcher.poll() is None and time.monotonic() < deadline, "the tasks never started"
            time.sleep(0.2)
        assert len(_session(launcher.pid)) >= 3  # launcher, workers, fork server, ...
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while (left := _session(launcher.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"{len(left)} processes of the killed launcher still run after 10 s"
    finally:
        for pid in _session(launcher.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_slurm_array_task_finds_datatrove_in_this_environment_without_activating_it(tmp_path):
    """A SLURM array task runs datatrove's `launch_pickled_pipeline` script: with `pretrain` started as
    venv/bin/pretrain (no venv activated) it was on no PATH in the task (`execve(): launch_pickled_pipeline: No
    such file or directory`, every task of `pretrain ladder --executor slurm` failed; found with
    scripts/slurm_one_node.sh). The launch file's environment line now finds it from a bare PATH."""
    import subprocess

    from pretrain.datamodules.executors import build_executor

    executor = build_executor("slurm", [lambda data, rank, world_size: data], 2, 1, tmp_path / "logs", {})
    script = executor.get_launch_file_contents({}, "command -v launch_pickled_pipeline")
    found = subprocess.run(
        ["bash", "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=False
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.split()[-1]).parent == Path(sys.executable).parent
