"""Checkpoint files: atomic writes, safe loading, `resume=auto` fallback, sharded consolidation, inference."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain import io as atomic
from pretrain.checkpoint.convert import consolidate, load_model
from pretrain.checkpoint.io import METADATA, PAYLOAD, read
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.checkpoint.optimizer_state import optimizer_state_by_name, optimizer_state_by_position
from pretrain.checkpoint.resume import check_compatible, checkpoint_step, find_resume, is_valid
from pretrain.io import replace_path
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

CONFIG = ModelConfig(arch="decoder", vocab_size=300, d_model=16, n_layer=1, n_head=2, d_ff=32, max_seq_len=16)


def lightning_like(step: int, model: Transformer | None = None) -> dict:
    model = model or Transformer(CONFIG)
    return {
        "global_step": step,
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        PAYLOAD: {
            "config": {"model": dataclasses.asdict(CONFIG)},
            "tokenizer_json": None,
            "wandb_run_id": "abc",
        },
    }


def save(path: Path, step: int, mtime: int) -> Path:
    AtomicCheckpointIO().save_checkpoint(lightning_like(step), path)
    os.utime(path, (mtime, mtime))
    return path


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    with pytest.raises((AttributeError, pickle.PicklingError)):  # a lambda cannot be pickled: the write fails
        io.save_checkpoint({"step": 2, "fn": lambda: 0}, path)
    assert io.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left behind


def test_a_file_checkpoint_replaces_a_sharded_one_of_the_same_name(tmp_path):
    """An FSDP run (last.ckpt a DCP directory) continued in its run directory by DDP or one device, as documented:
    the run trained, then its first save failed with "[Errno 21] Is a directory" (os.replace of a file onto a
    directory), the steps since the checkpoint lost."""
    from pretrain.checkpoint.io import write_atomically

    last = tmp_path / "last.ckpt"
    last.mkdir()
    (last / "meta.pt").write_bytes(b"sharded")
    write_atomically(last, lambda f: f.write(b"single"))
    assert last.is_file() and last.read_bytes() == b"single"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # nothing of the directory or the write left


def test_read_is_weights_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.ckpt")
    with pytest.raises(ValueError, match="weights-only load refuses") as err:
        read(tmp_path / "evil.ckpt")
    assert "weights_only=False" not in str(err.value)  # torch's advice would run the file's code
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "missing.ckpt")


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b"sentence\tlabel\nhello\tx\n",
            "is unreadable (truncated, corrupt or not a checkpoint)",
        ),  # IndexError
        (b"hello world\n", "is unreadable (truncated, corrupt or not a checkpoint)"),  # KeyError 101
        (
            None,
            "holds a Tensor, not a checkpoint (which is a mapping)",
        ),  # later: KeyError/TypeError of a caller
    ],
)
def test_a_file_that_is_no_checkpoint_is_one_line_for_every_reader(tmp_path, content, message):
    """`pretrain generate notes.tsv` (and evaluate, fit/finetune's init.checkpoint) ended in the unpickler's
    IndexError traceback; export and convert, which went another way, said "unreadable"."""
    path = tmp_path / "x.ckpt"
    if content is None:
        torch.save(torch.zeros(3), path)
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        read(path)


def test_validity_detects_truncation_and_flipped_bytes(tmp_path):
    good = save(tmp_path / "a.ckpt", 1, 1)
    assert is_valid(good)
    cut = save(tmp_path / "b.ckpt", 1, 1)
    truncate(cut)
    assert not is_valid(cut)
    flipped = save(tmp_path / "c.ckpt", 1, 1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor record: only the zip CRC notices
    flipped.write_bytes(bytes(data))
    assert not is_valid(flipped)


def test_find_resume_falls_back_from_a_truncated_newest(tmp_path):
    assert find_resume(tmp_path / "none") is None
    assert find_resume(tmp_path) is None
    save(tmp_path / "best-step2.ckpt", 2, 100)
    save(tmp_path / "step4.ckpt", 4, 200)
    newest = save(tmp_path / "last.ckpt", 6, 300)
    (tmp_path / ".last.ckpt.x1.tmp").write_bytes(b"partial")  # a crash mid-save leaves this: ignored
    assert find_resume(tmp_path) == newest
    truncate(newest)
    with pytest.warns(UserWarning, match="last.ckpt, which is truncated or corrupt"):
        assert find_resume(tmp_path) == tmp_path / "step4.ckpt"


def test_find_resume_picks_the_highest_step_not_the_newest_write(tmp_path):
    """A DeepSpeed directory keeps the modification time of its first save; Lightning's HPC checkpoints (in
    the run directory) are candidates; a sharded directory without its metadata is a partial save."""
    checkpoints = tmp_path / "checkpoints"
    deepspeed = checkpoints / "last.ckpt"  # the layout of Lightning's DeepSpeedStrategy.save_checkpoint
    (deepspeed / "checkpoint").mkdir(parents=True)
    torch.save({"global_step": 8, "module": {}}, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt")
    (deepspeed / "latest").write_text("checkpoint")
    os.utime(deepspeed, (100, 100))
    save(checkpoints / "best-step4.ckpt", 4, 500)
    partial = checkpoints / "best-step9.ckpt"  # killed while its shards were written: no `latest` yet
    (partial / "checkpoint").mkdir(parents=True)
    with pytest.warns(UserWarning, match="best-step9.ckpt, which is truncated or corrupt"):
        assert find_resume(checkpoints, hpc_dir=tmp_path) == deepspeed
    hpc = save(tmp_path / "hpc_ckpt_1.ckpt", 9, 50)
    save(tmp_path / "unrelated.ckpt", 20, 600)  # only hpc_ckpt_* of the run directory are candidates
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert find_resume(checkpoints, hpc_dir=tmp_path) == hpc
        assert find_resume(checkpoints) == deepspeed


def test_find_resume_reads_the_step_of_an_fsdp_sharded_directory(tmp_path):
    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    AtomicCheckpointIO().save_checkpoint(lightning_like(7), sharded / METADATA)
    (sharded / ".metadata").write_bytes(b"")
    os.utime(sharded, (100, 100))
    save(tmp_path / "best-step3.ckpt", 3, 500)
    assert find_resume(tmp_path) == sharded


def test_find_resume_with_no_valid_checkpoint_is_an_error(tmp_path):
    truncate(save(tmp_path / "last.ckpt", 1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="no valid checkpoint"):
            find_resume(tmp_path)


def test_check_compatible_names_the_differences():
    saved = dataclasses.asdict(CONFIG)
    check_compatible(saved, dict(saved), "x.ckpt")
    other = dataclasses.asdict(dataclasses.replace(CONFIG, arch="encoder", d_model=32))
    with pytest.raises(ValueError, match=r"model.arch: checkpoint 'decoder' vs config 'encoder'.*d_model"):
        check_compatible(saved, other, "x.ckpt")


def test_consolidate_an_fsdp_sharded_checkpoint(tmp_path):
    """The FSDP layout: torch.distributed.checkpoint shards of weights and name-keyed optimizer state + meta.pt for
    the rest; consolidated into a single-process checkpoint (optimizer state numbered in group order)."""
    full = lightning_like(3)
    directory = tmp_path / "last.ckpt"
    weights = full.pop("state_dict")
    a, b = "model.embed.tok.weight", "model.final_norm.weight"
    moments = {a: {"exp_avg": torch.ones(2)}, b: {"exp_avg": torch.zeros(3)}}
    groups = [{"lr": 0.1, "params": [b]}, {"lr": 0.2, "params": [a]}]
    shards = {"state_dict": weights, "optimizer_0": {"state": moments, "param_groups": groups}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: single-process save
        dcp.save(shards, checkpoint_id=directory)
    assert not is_valid(directory)  # shards without meta.pt: incomplete
    torch.save({k: v for k, v in full.items() if k != "optimizer_states"}, directory / METADATA)
    assert is_valid(directory)
    single = consolidate(directory, tmp_path / "single.ckpt")
    merged = read(single)
    assert merged["global_step"] == 3 and merged[PAYLOAD]["wandb_run_id"] == "abc"
    for key, value in weights.items():
        assert torch.equal(merged["state_dict"][key], value)
    optimizer = merged["optimizer_states"][0]
    assert [g["params"] for g in optimizer["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in optimizer["param_groups"]] == [0.1, 0.2]
    assert torch.equal(optimizer["state"][0]["exp_avg"], torch.zeros(3))
    assert (
        optimizer_state_by_position(optimizer_state_by_name(optimizer, *named_optimizer(a, b))) == optimizer
    )
    model, info, tokenizer = load_model(directory)  # inference straight from the sharded directory
    assert tokenizer is None and info["wandb_run_id"] == "abc"
    assert torch.equal(model.state_dict()["embed.tok.weight"], weights["model.embed.tok.weight"])


def named_optimizer(a: str, b: str) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
    """An optimizer whose groups list parameter ``b`` then ``a`` of a module (names relative to it)."""
    module = torch.nn.Module()
    for name in (a, b):
        *parents, leaf = name.split(".")
        owner = module
        for parent in parents:
            if not hasattr(owner, parent):
                owner.add_module(parent, torch.nn.Module())
            owner = getattr(owner, parent)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(1)))
    params = dict(module.named_parameters())
    optimizer = torch.optim.SGD([{"params": [params[b]], "lr": 0.1}, {"params": [params[a]], "lr": 0.2}])
    return optimizer, module


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("old", ["file", "directory", None])
def test_replace_path_swaps_in_a_complete_checkpoint(tmp_path, monkeypatch, old, exchange):
    """A sharded save lands by one rename (or two, without renameat2): the new directory replaces a previous file
    or directory (or nothing), and nothing of the old one or the temporary name is left."""
    if not exchange:
        monkeypatch.setattr(atomic, "_rename_exchange", lambda src, dst: False)
    target = tmp_path / "last.ckpt"
    if old == "file":
        target.write_text("old")
    elif old == "directory":
        (target / "sub").mkdir(parents=True)
        (target / "sub" / "x").write_text("old")
    new = tmp_path / ".last.ckpt.tmp"
    new.mkdir()
    (new / "meta.pt").write_text("new")
    replace_path(new, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert sorted(p.name for p in target.iterdir()) == ["meta.pt"]


def test_replace_path_without_exchange_puts_the_old_one_back_on_failure(tmp_path, monkeypatch):
    target, new = tmp_path / "data", tmp_path / ".data.tmp"
    (target / "old").mkdir(parents=True)
    new.mkdir()
    monkeypatch.setattr(atomic, "_rename_exchange", lambda src, dst: False)
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OSError, match="No space"):
        replace_path(new, target)
    assert (target / "old").is_dir() and new.is_dir()


def test_consolidate_rejects_other_directories(tmp_path):
    with pytest.raises(ValueError, match="is a directory, not a checkpoint"):
        consolidate(tmp_path, tmp_path / "out.ckpt")


def test_load_model_restores_weights_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    model = Transformer(CONFIG)
    ckpt = lightning_like(1, model)
    ckpt[PAYLOAD]["tokenizer_json"] = Tokenizer(models.BPE()).to_str()
    AtomicCheckpointIO().save_checkpoint(ckpt, tmp_path / "m.ckpt")
    loaded, _, tokenizer = load_model(tmp_path / "m.ckpt")
    assert isinstance(tokenizer, Tokenizer) and not loaded.training
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="not a checkpoint written by `pretrain fit`"):
        load_model(tmp_path / "foreign.ckpt")


def test_disk_full_frees_what_the_retention_policy_no_longer_keeps(tmp_path, monkeypatch):
    """ENOSPC while a file the policy dropped is still on disk: it is deleted, the write retried and done.
    With nothing to free, the error names the intact checkpoints and leaves them loadable."""
    import errno

    from pretrain.checkpoint import CheckpointWriteError

    dropped, last = save(tmp_path / "best-step2-loss5.0000.ckpt", 2, 2), save(tmp_path / "last.ckpt", 3, 3)
    real_save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        if dropped.exists() or obj.get("step") == 5:  # full until `dropped` goes; step 5 never fits
            f.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_save)
    io = AtomicCheckpointIO(reclaimable=lambda: [dropped])
    with pytest.warns(UserWarning, match="retention policy no longer keeps"):
        io.save_checkpoint({"step": 4}, tmp_path / "best-step4-loss4.0000.ckpt")
    assert not dropped.exists() and read(tmp_path / "best-step4-loss4.0000.ckpt")["step"] == 4
    with pytest.raises(CheckpointWriteError, match="No space left on device.*intact.*last.ckpt") as err:
        io.save_checkpoint({"step": 5}, last)
    assert err.value.errno == errno.ENOSPC and read(last)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-step4-loss4.0000.ckpt", "last.ckpt"]


def test_a_finished_runs_best_checkpoint_newer_than_last_becomes_last(tmp_path):
    """A kill between the final validation's best-k save and the final ``last.ckpt``: the rerun has no step left
    to save, so ``resume=auto`` makes that newest state ``last.ckpt`` (what export and finetuning read)."""
    from types import SimpleNamespace

    from pretrain.training.setup import resume_path

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    save(checkpoints / "last.ckpt", 7, 100)
    save(checkpoints / "best-step8.ckpt", 8, 200)
    run = SimpleNamespace(
        resume="auto", checkpoint_dir=checkpoints, run_dir=tmp_path, trainer=SimpleNamespace(max_steps=9)
    )
    assert resume_path(run) == checkpoints / "best-step8.ckpt"  # steps left: training writes last.ckpt itself
    run.trainer.max_steps = 8
    assert resume_path(run) == checkpoints / "last.ckpt"
    assert checkpoint_step(checkpoints / "last.ckpt") == 8 and (checkpoints / "best-step8.ckpt").is_file()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best-step8.ckpt", "last.ckpt"]


def test_a_fresh_run_under_an_earlier_runs_name_never_resumes_its_checkpoints(tmp_path, monkeypatch):
    """`pretrain fit ... resume=null` where an earlier run under the name left checkpoints (best-step4), then the
    same command again: resume=auto took the earlier run's step 4 for this run's (and copied it over this run's
    last.ckpt of step 2). A fresh run now moves the earlier checkpoints aside, deleting none."""
    from types import SimpleNamespace

    from pretrain.training.setup import resume_path, set_aside_checkpoints

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    save(checkpoints / "last.ckpt", 4, 100)
    save(checkpoints / "best-step4.ckpt", 4, 100)
    save(tmp_path / "hpc_ckpt_1.ckpt", 4, 100)
    (tmp_path / "logs" / "version_0").mkdir(parents=True)
    (tmp_path / "logs" / "version_0" / "metrics.csv").write_text("step\n4\n")  # its CSV log (#32 sweep)
    (tmp_path / "results.json").write_text("{}")  # a finetune's outputs: a fresh run killed early left them
    (tmp_path / "finetuned.pt").write_bytes(b"earlier")  # as its own (#32 sweep)
    run = SimpleNamespace(resume=None, checkpoint_dir=checkpoints, run_dir=tmp_path, run_path=tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "1")  # another rank of a launch leaves it to the first
    assert set_aside_checkpoints(run) is None
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.warns(
        UserWarning,
        match="3 checkpoint.* of an earlier run .* moved to .* with its results.json, finetuned.pt and its CSV logs",
    ):
        aside = set_aside_checkpoints(run)
    assert sorted(p.name for p in aside.iterdir()) == [
        "best-step4.ckpt",
        "finetuned.pt",
        "hpc_ckpt_1.ckpt",
        "last.ckpt",
        "results.json",
    ]
    assert (tmp_path / "logs" / aside.name / "version_0" / "metrics.csv").read_text() == "step\n4\n"
    assert not list((tmp_path / "logs").glob("version_*"))  # curves.png and `pretrain plot` read those
    save(checkpoints / "last.ckpt", 2, 200)  # the fresh run's own
    run.resume, run.trainer = "auto", SimpleNamespace(max_steps=4)
    assert resume_path(run) == checkpoints / "last.ckpt" and checkpoint_step(checkpoints / "last.ckpt") == 2


def test_checkpoint_readers_import_no_lightning():
    """``pretrain.checkpoint`` (but ``lightning_io``) imports no Lightning: a verb may import it before
    ``pretrain.compat.lightning``, which must run before Lightning's first import (torchmetrics without extras)."""
    import subprocess
    import sys

    code = (
        "import sys, pretrain.checkpoint, pretrain.checkpoint.reshard, pretrain.checkpoint.merge; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torchmetrics', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_fit_resume_compares_the_checkpoint_its_weights_started_from(tmp_path, monkeypatch):
    """Resuming a run started with init.checkpoint=A under init.checkpoint=B was silently accepted: the weights
    continued from A's descendants while every later checkpoint recorded B. Now refused in one line; A spelled
    otherwise (./A, an absolute path) is the same file."""
    from pretrain.training.setup import FIT_RESUME, compare_for_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.ckpt").write_text("a")
    (tmp_path / "b.ckpt").write_text("b")

    def payload(init: str | None) -> dict:
        return {"config": {"seed": 1, "init": {"checkpoint": init}}}

    table = FIT_RESUME[:2]  # seed, init.checkpoint
    for same in ("./a.ckpt", str(tmp_path / "a.ckpt")):
        assert compare_for_resume(table, payload("a.ckpt"), payload(same), [], "last.ckpt") == []
    for other in ("b.ckpt", None):
        with pytest.raises(
            ValueError, match=r"init.checkpoint: checkpoint '.*a.ckpt' vs config .*cannot change"
        ):
            compare_for_resume(table, payload("a.ckpt"), payload(other), ["optimizer"], "last.ckpt")


def test_a_finetune_checkpoint_where_a_fit_one_is_read_is_one_line(tmp_path, capsys):
    """`pretrain generate runs/ft/checkpoints/last.ckpt` and `pretrain fit ... init.checkpoint=runs/ft/...` ended in
    load_state_dict's missing/unexpected keys traceback ('this is a bug in pretrain'), `pretrain validate --ckpt` in
    a resume refusal about tokenizers: a finetune's checkpoint (backbone.* and head weights) is now named as such,
    with its backbone's path and `pretrain export`. Found by the #32 sweep."""
    from pretrain.checkpoint.convert import initial_weights
    from pretrain.cli import main
    from pretrain.errors import InputError

    ckpt = lightning_like(2)
    ckpt["state_dict"] = {f"model.backbone.{k[len('model.') :]}": v for k, v in ckpt["state_dict"].items()}
    ckpt[PAYLOAD]["finetune"] = {"init": {"checkpoint": "runs/base/checkpoints/last.ckpt"}}
    path = tmp_path / "ft.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(
        InputError, match=r"is a `pretrain finetune` checkpoint .* \(runs/base/checkpoints/last.ckpt\)"
    ):
        load_model(path)
    with pytest.raises(InputError, match=r"^init.checkpoint: .* is a `pretrain finetune` checkpoint"):
        initial_weights(path, Transformer(CONFIG), "{}")
    assert main(["generate", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "is a `pretrain finetune` checkpoint" in err and "Traceback" not in err
