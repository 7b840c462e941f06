"""The ``pretrain`` commands of every docs page run as written (issue 31), after a tiny GPT run in
``runs/gpt-tiny`` (what ``make demo`` leaves; trained once, each page runs in a copy), in each page's order;
``PRETRAIN_OVERRIDES`` cuts every training run to 2 steps. A command that cannot run here is listed in
``NOT_RUN`` with the reason and the test that covers it instead, so a new docs command is either run or named."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from test_documented_commands import SHORT, run
from training_utils import REPO_ROOT

DOCS = REPO_ROOT / "docs"
NOT_RUN = {  # command as written (its words joined by spaces) -> why it does not run here (and what covers it)
    "pretrain fit recipes/gpt2-124m.yaml guards.hang.factor=10 guards.hang.min_seconds=600 "
    "guards.spike.lr_factor=1": "a GPU recipe (composes: test_recipes.py::test_every_documented_fit_command_composes)",
    "pretrain merge runs/a/checkpoints/best-step200.ckpt runs/a/checkpoints/best-step240.ckpt --out merged.ckpt": (
        "names another run's checkpoints (merge of every layout: test_reshard.py, test_checkpoint_merge.py)"
    ),
    "pretrain merge A.ckpt B_DIR C.ckpt --out merged.ckpt --weights 0.5,0.25,0.25": "placeholder paths (as above)",
    "pretrain prepare recipes/gpt-tiny.yaml --executor slurm --tasks 256 --partition cpu --time 4:00:00": (
        "needs a SLURM cluster (scripts/slurm_one_node.sh runs prepare's and ladder's arrays)"
    ),
    "pretrain finetune recipes/finetune-sst2-minilm.yaml [key=value ...]": "a usage line ([key=value ...])",
    "pretrain finetune recipes/finetune-t5-sst2.yaml trainer.devices=8 strategy.name=fsdp": "8 devices",
    "pretrain finetune recipes/finetune-sst2-minilm.yaml trainer.devices=8 strategy.name=deepspeed "
    "strategy.deepspeed.stage=3": "8 devices",
    "pretrain ladder recipes/ladder-tiny.yaml --out runs/ladder-tiny": (
        "trains 12 whole cells (a cell's plan ignores PRETRAIN_OVERRIDES): the reduced ladder is test_ladder.py's"
    ),
    "pretrain ladder runs/ladder-tiny --budget 1e13": "reads the ladder above (test_ladder.py runs --budget)",
    "pretrain ladder recipes/ladder-tiny.yaml ladder.sizes=[{d_model: 32, n_layer: 2},{d_model: 64, n_layer: 1},"
    "{d_model: 64, n_layer: 2},{d_model: 96, n_layer: 2},{d_model: 128, n_layer: 2}] "
    "ladder.flops=[6e11,1.8e12,5.4e12] --out runs/ladder-5x3": "15 whole cells, 21-36 min (as above)",
    "pretrain ladder recipes/ladder-tiny-mlm.yaml ladder.sizes=[{d_model: 32, n_layer: 2},{d_model: 64, n_layer: 1},"
    "{d_model: 64, n_layer: 2},{d_model: 96, n_layer: 2},{d_model: 128, n_layer: 2}] "
    "ladder.flops=[6e11,1.8e12,5.4e12] --out runs/ladder-mlm-5x3": "15 whole cells (as above)",
}
SHARED_DATA = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
# pages whose commands need the shared data directory (present in CI)
SHARED = {"attention.md", "evaluation.md", "finetuning.md", "long-context.md"}


def page_commands(page: Path) -> list[list[str]]:
    """The ``pretrain ...`` commands (argv) of the page's bash blocks, continuation lines joined, ``a && b`` split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split(" && "):
                if part.startswith("pretrain "):
                    commands.append(shlex.split(part, comments=True))
    return commands


PAGES = sorted(p for p in DOCS.glob("*.md") if page_commands(p))
# `pretrain plan` of the 124M recipe on 8 GPUs with TP x CP traces every layout: ~4 CPU-min (its rows on a tiny
# model are checked against real gloo ranks in test_plan.py); attention.md prepares WikiText-2 and trains at 4,096
# tokens (~110 s; its attention paths are test_attention's, its recipes composed by test_recipes); long-runs.md
# fits the 124M recipe and converts, merges and exports (~140 s; each verb's own test runs in make test:
# test_reshard, test_async_checkpoint, test_ema, test_checkpoint_merge, test_export_streamed); modernbert.md tokenizes, prepares
# and fits its recipe (~57 s; test_recipes and test_hf cover it). They left make test when CI ran 1,243 s (budget 1,200)
HEAVY = {"gpu.md", "attention.md", "long-runs.md", "modernbert.md"}
RUN = [
    pytest.param(p, id=p.name, marks=[pytest.mark.heavy] if p.name in HEAVY else [])
    for p in PAGES
    if any(" ".join(argv) not in NOT_RUN for argv in page_commands(p))
]


def test_every_command_not_run_is_still_documented():
    documented = {" ".join(argv) for page in PAGES for argv in page_commands(page)}
    assert set(NOT_RUN) <= documented, set(NOT_RUN) - documented


@pytest.fixture(scope="module")
def demo_work(tmp_path_factory, shakespeare) -> Path:
    """A work directory as ``make demo`` leaves it: the recipes' tokenizer and corpus under ``runs/``, and a tiny
    GPT run in ``runs/gpt-tiny`` (2 steps); trained once, each page gets a copy."""
    work = tmp_path_factory.mktemp("demo") / "work"
    (work / "runs" / "tokenizers").mkdir(parents=True)
    shutil.copy(shakespeare["root"] / "tokenizer.json", work / "runs/tokenizers/tinyshakespeare-bpe1k.json")
    shutil.copytree(shakespeare["root"] / "data", work / "runs/data/tinyshakespeare-bpe1k")
    run(work, ["pretrain", "fit", "recipes/gpt-tiny.yaml"], SHORT["fit"])
    return work


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN)
def test_docs_page_commands_run_as_written(request, tmp_path, demo_work, page):
    # skipped without it on a developer's machine, failed in CI (tests/conftest.py's shared_data)
    shared = request.getfixturevalue("shared_data") if page.name in SHARED else SHARED_DATA
    work = tmp_path / "work"
    shutil.copytree(demo_work, work, symlinks=True)
    if shared.is_dir():  # `--data-root ../shared/data` as written
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(shared.resolve())
    short = dict(SHORT)
    if shared.is_dir():  # a finetune's final evaluation on 16 SST-2 rows, not 872
        dev = tmp_path / "dev.tsv"
        dev.write_text("".join((shared / "cls/glue/SST-2/dev.tsv").read_text().splitlines(True)[:17]))
        kept = [o for o in short["finetune"].split() if not o.startswith("data.val_file=")]
        short["finetune"] = " ".join([*kept, f"data.val_file={dev}"])
    for argv in page_commands(page):
        if " ".join(argv) not in NOT_RUN:
            run(work, argv, short.get(argv[1], ""))
