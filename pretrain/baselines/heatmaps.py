"""Attention heatmaps of a seq2seq model: the weights of the decoder producing an output, drawn as a PNG."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from pretrain.io import atomic_write
from pretrain.models.rnn import Seq2SeqRNN


@torch.no_grad()
def alignment(model: Seq2SeqRNN, source: list[int], output: list[int]) -> Tensor:
    """Attention weights (len(output) + 1, len(source)) of the decoder producing ``output`` + EOS from ``source``."""
    c = model.config
    out = model(
        input_ids=torch.tensor([source]),
        decoder_input_ids=torch.tensor([[c.decoder_start_token_id, *output]]),
    )
    return out.attention[0]


def save_alignment(
    weights: Tensor, source: Sequence[str], target: Sequence[str], path: str | os.PathLike
) -> Path:
    """Heatmap of attention ``weights (T, S)``: target tokens down, source tokens across (PNG via matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("attention heatmaps need matplotlib: pip install matplotlib") from err
    if tuple(weights.shape) != (len(target), len(source)):
        raise ValueError(f"weights {tuple(weights.shape)} do not match {len(target)} x {len(source)} tokens")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(source), 1 + 0.45 * len(target)))
    image = ax.imshow(weights.float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(source)), labels=list(source), rotation=90)
    ax.set_yticks(range(len(target)), labels=list(target))
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    return [
        tokenizer.decode([i], skip_special_tokens=False).strip() or tokenizer.id_to_token(i) or ""
        for i in ids
    ]
