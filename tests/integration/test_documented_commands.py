"""The documented commands run as written, in their order, right after ``make demo`` and do what they say
(issue 22): the README's CLI block, and the recipes README's first and tiny-recipe blocks.
``PRETRAIN_OVERRIDES`` cuts every training run to 2 steps; the commands themselves are read from the READMEs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_utils import REPO_ROOT, cli_env

SHORT = {
    "fit": "trainer.max_steps=2 trainer.val_check_interval=2 trainer.limit_val_batches=1 checkpoint.every_n_steps=2 "
    "data.micro_batch_size=2 logger.wandb.enabled=false",
    "validate": "trainer.limit_val_batches=1 data.micro_batch_size=2",
    "baseline": "trainer.max_steps=2 trainer.val_check_interval=2 trainer.limit_val_batches=1 data.micro_batch_size=2 "
    "logger.wandb.enabled=false",
    "finetune": "trainer.max_steps=2 trainer.val_check_interval=2 trainer.limit_val_batches=1 data.micro_batch_size=4",
}  # `evaluate` runs as written (its --limit is part of the command: a shorter one would hide a too-long example)


def commands(readme: Path, after: str) -> list[list[str]]:
    """The ``pretrain ...`` lines of the first ```bash block after the line starting with ``after``."""
    text = readme.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(after) :], re.DOTALL).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("pretrain ")]


def run(work: Path, argv: list[str], overrides: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pretrain", *argv[1:]] if argv[0] == "pretrain" else argv,
        cwd=work,
        env=cli_env(
            PRETRAIN_OVERRIDES=SHORT.get(argv[1], "") if overrides is None else overrides,
            PYTHON=sys.executable,
        ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (
        f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.slow
def test_documented_commands_run_in_order_after_make_demo(tmp_path, shakespeare):
    work = tmp_path / "work"
    (work / "recipes").mkdir(parents=True)
    # the recipes' tokenizer and prepared corpus, as `pretrain tokenizer` / `prepare` wrote them (the session's):
    # the demo reuses them, as a second `make demo` does
    (work / "runs" / "tokenizers").mkdir(parents=True)
    shutil.copy(shakespeare["root"] / "tokenizer.json", work / "runs/tokenizers/tinyshakespeare-bpe1k.json")
    shutil.copytree(shakespeare["root"] / "data", work / "runs/data/tinyshakespeare-bpe1k")
    shutil.copy(REPO_ROOT / "recipes" / "demo.sh", work / "recipes" / "demo.sh")  # it runs from its parent
    shared = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if shared.is_dir():  # `--data-root ../shared/data` as the README writes it
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(shared.resolve())
        dev = tmp_path / "dev.tsv"  # the finetune's final evaluation on 16 SST-2 rows, not 872
        dev.write_text("".join((shared / "cls/glue/SST-2/dev.tsv").read_text().splitlines(True)[:17]))
        SHORT["finetune"] += f" data.val_file={dev}"
    # `make demo` after `make install`, with its offline W&B run
    out = run(work, ["bash", "recipes/demo.sh"], SHORT["fit"].replace("logger.wandb.enabled=false", ""))
    assert (work / "runs/gpt-tiny/checkpoints/last.ckpt").is_file()
    assert "reusing it" in out and "prepared tinyshakespeare" in out
    assert "== pretrain fit: done ==" in out and "--- sample 0 ---\nROMEO:" in out
    # the offline W&B run is where our summary says (its directory; W&B's file format is not ours to read)
    (line,) = [ln for ln in out.splitlines() if "W&B run:" in ln]
    wandb_dir = (work / line.rsplit(" ", 1)[1]).resolve()
    assert (
        "(offline)" in line
        and wandb_dir.is_dir()
        and wandb_dir.is_relative_to((work / "runs/gpt-tiny").resolve())
    )

    readme = commands(REPO_ROOT / "README.md", "## The CLI")
    assert len(readme) == 10
    for argv in readme:
        if not shared.is_dir() and argv[1] in ("finetune", "evaluate"):
            continue  # their data is the shared directory (present in CI)
        out = run(work, argv)
        if argv[1] == "fit":  # a new run of 2 layers, not a refused resume of the demo's 4-layer run
            saved = torch.load(work / "runs/gpt-tiny-2layer/checkpoints/last.ckpt", weights_only=True)
            assert saved["pretrain"]["config"]["model"]["n_layer"] == 2
        if argv[1] == "generate":
            assert "ROMEO:" in out
    assert (work / "runs/gpt-tiny-hf/config.json").is_file() and (work / "runs/curves.png").is_file()
    # every output under runs/ (ignored by git), none in the root
    assert sorted(p.name for p in work.iterdir()) == ["recipes", "runs"]

    # (the recipes README's sharded CPU examples run as written in test_recipes.py)
    for argv in commands(REPO_ROOT / "recipes" / "README.md", "A recipe is a YAML file"):
        run(work, argv)
    tiny = commands(REPO_ROOT / "recipes" / "README.md", "All use a 1024-token byte-level BPE")
    for argv in tiny:
        out = run(work, argv)
    assert "returns the spans its input's sentinels stand for" in out  # the T5 sample says what it is
