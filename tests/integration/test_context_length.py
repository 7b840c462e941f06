"""Long-context recipes run end to end (CI smoke: tokenizer, prepare, 2 fit steps at 4,096 tokens each) and the
loss-by-context evaluation reads the trained decoder; its position bookkeeping is checked on a known model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from training_utils import REPO_ROOT, Background, cli_env, run_cli

from pretrain.evaluation.context_length import by_context, position_losses
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


def test_position_losses_average_windows_by_position():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=11, d_model=16, n_layer=1, n_head=2, max_seq_len=8)).eval()
    tokens = torch.randint(0, 11, (8 * 3 + 5,))  # 3 windows of 8; the 5 left over are not used
    losses = position_losses(model, tokens, 8, batch_size=2)
    windows = tokens[:24].view(3, 8)
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    expected = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)
    torch.testing.assert_close(losses.float(), expected)
    rows = by_context(losses)
    assert [(a, b) for a, b, _ in rows] == [(1, 2), (2, 4), (4, 8)]
    assert rows[2][2] == pytest.approx(losses[3:7].mean().item())
    with pytest.raises(ValueError, match="fewer than one window"):
        position_losses(model, tokens[:5], 8)


@pytest.mark.slow
@pytest.mark.heavy
def test_long_context_recipes_run(tmp_path, shared_data):
    paths = [f"tokenizer.path={tmp_path / 'tok.json'}", f"data.sources.0.prepared={tmp_path / 'data'}"]
    run_cli("tokenizer", "recipes/swa-decoder-wikitext2.yaml", *paths, PRETRAIN_SHARED_DATA=str(shared_data))
    run_cli("prepare", "recipes/swa-decoder-wikitext2.yaml", *paths, PRETRAIN_SHARED_DATA=str(shared_data))
    quick = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    quick += ["trainer.progress_bar=false", "logger.wandb.enabled=false", "checkpoint.every_n_steps=2"]
    fits = [  # side by side: one thread each
        Background(
            "fit",
            f"recipes/{recipe}.yaml",
            *paths,
            *quick,
            f"run_dir={tmp_path / recipe}",
            log=tmp_path / f"{recipe}.log",
            PRETRAIN_SHARED_DATA=str(shared_data),
        )
        for recipe in ("bigbird-wikitext2", "swa-decoder-wikitext2", "long-context-base")
    ]
    for fit in fits:
        fit.wait()
    # the YaRN extension starts from long-context-base's weights (init.checkpoint), at 1,024 tokens
    base = tmp_path / "long-context-base" / "checkpoints" / "last.ckpt"
    yarn = tmp_path / "long-context-yarn"
    args = [*paths, *quick, f"run_dir={yarn}", f"init.checkpoint={base}"]
    run_cli("fit", "recipes/long-context-yarn.yaml", *args, PRETRAIN_SHARED_DATA=str(shared_data))
    assert (yarn / "checkpoints" / "last.ckpt").is_file()
    command = [
        sys.executable,
        "-m",
        "pretrain.evaluation.context_length",
        str(tmp_path / "swa-decoder-wikitext2"),
    ]
    command += [
        "--text",
        str(shared_data / "lm/wikitext-2/test.txt"),
        "--context",
        "4096",
        "--max-windows",
        "1",
    ]
    out = subprocess.run(
        command, check=False, cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "| 2048-4095 |" in out.stdout
