"""The tiny recipes train through the CLI on the shipped corpus and beat the unigram baseline (demo.sh runs in
``test_documented_commands.py``)."""

from __future__ import annotations

import math

import pytest
from training_utils import REPO_ROOT, Background, metric_by_step, read_metrics

# optimizer steps per recipe (the recipes' own batch and model); the three run side by side
STEPS = {"gpt-tiny": 60, "t5-tiny": 80, "bert-tiny": 300}


@pytest.fixture(scope="module")
def trained(shakespeare) -> dict:
    runs = {}
    for recipe, steps in STEPS.items():
        run_dir = shakespeare["root"] / recipe
        runs[recipe] = (
            run_dir,
            Background(
                "fit",
                f"recipes/{recipe}.yaml",
                *shakespeare["paths"],
                f"run_dir={run_dir}",
                f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={steps}",
                "trainer.progress_bar=false",
                "logger.wandb.enabled=false",
                "checkpoint.save_top_k=0",
                log=shakespeare["root"] / f"{recipe}.log",
            ),
        )
    for run_dir, background in runs.values():
        background.wait(timeout=1800)
    return {recipe: run_dir for recipe, (run_dir, _) in runs.items()}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("recipe", sorted(STEPS))
def test_tiny_recipe_beats_the_unigram_baseline(shakespeare, trained, recipe):
    val = metric_by_step(read_metrics(trained[recipe]), "val/loss")
    assert list(val) == [STEPS[recipe]]
    baseline = shakespeare["unigram"]
    assert 5.0 < baseline < 7.0  # a 1024-token BPE on English text
    assert val[STEPS[recipe]] < baseline - 0.1, (recipe, val, baseline)  # 10% lower perplexity at least


@pytest.mark.parametrize("recipe", ["ul2-tiny", "prefixlm-tiny"])
def test_ul2_and_prefix_lm_recipes_train(shakespeare, tmp_path, recipe):
    from pretrain.cli import main

    args = [
        *shakespeare["paths"],
        f"run_dir={tmp_path}",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "data.micro_batch_size=2",
        "logger.wandb.enabled=false",
    ]
    assert main(["fit", str(REPO_ROOT / "recipes" / f"{recipe}.yaml"), *args]) == 0
    losses = metric_by_step(read_metrics(tmp_path), "train/loss")
    assert sorted(losses) == [1, 2, 3]
    # a mean over real targets of a fresh model: near log(vocab) = 6.93 nats, never 0 (no targets) or a sum
    assert all(0.7 * math.log(1024) < v < 1.3 * math.log(1024) for v in losses.values()), losses
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def readme_fit_examples(pattern: str = r"recipes/[^`\n]*strategy\.name=[^`\n]*") -> list[list[str]]:
    """Every ``pretrain fit <pattern>`` example (by default ``recipes/... strategy.name=...``) of README.md,
    recipes/README.md and the docs/ pages (inline code or code blocks), as argument lists."""
    import re
    import shlex

    commands = []
    pages = [
        REPO_ROOT / "README.md",
        REPO_ROOT / "recipes" / "README.md",
        *sorted((REPO_ROOT / "docs").glob("*.md")),
    ]
    for readme in pages:
        for match in re.finditer(rf"pretrain fit +({pattern})", readme.read_text()):
            args = shlex.split(match.group(1).split("#")[0].rstrip("\\"))
            if args not in commands:
                commands.append(args)
    return commands


EXAMPLES = readme_fit_examples()
# docs/pretraining.md's FSDP example sits in a bash block, which test_documented_commands_docs.py runs as written
PRETRAINING_FSDP = ["recipes/gpt-tiny.yaml", "trainer.devices=2", "strategy.name=fsdp", "name=gpt-tiny-fsdp"]
CPU_EXAMPLES = [args for args in EXAMPLES if args[0].endswith("-tiny.yaml") and args != PRETRAINING_FSDP]


def test_every_documented_fit_command_composes():
    """Every ``pretrain fit recipes/...`` line of the README and docs (GPU and shared-data runs included, which
    cannot run here) composes as written: its recipe exists and its overrides name real keys with valid values."""
    from pretrain import config

    documented = readme_fit_examples(r"recipes/[^`\n]*")
    assert len(documented) >= 15, documented
    for recipe, *overrides in documented:
        config.load(REPO_ROOT / recipe, [o for o in overrides if not o.startswith("--")])


def test_readme_strategy_examples_compose_and_build_their_strategy():
    """The GPU examples (8-GPU recipes) cannot train here: their config and strategy must still build."""
    from pretrain import config
    from pretrain.training.strategies import build_strategy

    assert len(EXAMPLES) >= 4 and len(CPU_EXAMPLES) >= 2, EXAMPLES
    assert (
        f"```bash\npretrain fit {' '.join(PRETRAINING_FSDP)}\n"
        in (REPO_ROOT / "docs/pretraining.md").read_text()
    )
    for recipe, *overrides in EXAMPLES:
        run, _ = config.load(REPO_ROOT / recipe, overrides)
        assert build_strategy(run) != "auto"


@pytest.mark.slow
def test_readme_cpu_strategy_examples_run_as_written(shakespeare, tmp_path):
    """The CPU examples, as written, plus only where to put data and run, and a short schedule (those of a docs
    page's bash block run in test_documented_commands_docs.py). DeepSpeed compiles nothing: its CPU shared-memory
    all-reduce is not built (``pretrain.compat.lightning.without_shared_memory_allreduce``)."""
    runs = []
    extensions = tmp_path / "torch_extensions"  # where DeepSpeed would compile its ops: nothing is built
    for i, (recipe, *overrides) in enumerate(CPU_EXAMPLES):
        short = [f"run_dir={tmp_path / str(i)}", "trainer.max_steps=2", "trainer.val_check_interval=2"]
        extra = [*shakespeare["paths"], *short, "trainer.log_every_n_steps=1", "logger.wandb.enabled=false"]
        log = tmp_path / f"{i}.log"
        runs.append(
            Background("fit", recipe, *overrides, *extra, log=log, TORCH_EXTENSIONS_DIR=str(extensions))
        )
    for i, run in enumerate(runs):
        run.wait(timeout=900)
        assert sorted(metric_by_step(read_metrics(tmp_path / str(i)), "train/loss")) == [1, 2]
        assert "built successfully" not in run.log.read_text()
    assert not extensions.exists()


def test_modernbert_base_recipe_has_the_published_size():
    """recipes/modernbert-base.yaml builds (on the meta device) with ModernBERT-base's parameter count: exactly
    transformers' ModernBertForMaskedLM(ModernBertConfig()) (whose defaults are ModernBERT-base), and within 1 %
    of the published 149M."""
    import torch
    import transformers

    from pretrain.config.run import load
    from pretrain.models.transformer import Transformer

    run, _ = load(REPO_ROOT / "recipes" / "modernbert-base.yaml")
    assert run.objective.options["mlm_probability"] == 0.3 and run.data.seq_len == 1024
    with torch.device("meta"):
        ours = Transformer(run.model).num_params()
        reference = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig())
    assert ours == sum(p.numel() for p in reference.parameters())
    assert abs(ours / 149e6 - 1) < 0.01
