"""Text-to-text decoding of a batch's sources with the KV cache: greedy, sampling or beam search."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from pretrain.finetuning.config import DecodingConfig
from pretrain.models.transformer import Transformer


def decode_targets(
    model: Transformer,
    batch: dict[str, Tensor],
    cfg: DecodingConfig,
    eos: int,
    pad: int,
    all_finished: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """Generated target tokens (B, n) for the sources of ``batch`` (pad after EOS): greedy, sampling or beam.
    ``all_finished``: when to stop (``pretrain.models.generation.generate``, ``pretrain.models.beam_search``):
    sharded ranks agree, so that every rank runs the same forwards."""
    from pretrain.models.beam_search import beam_search
    from pretrain.models.generation import generate

    if cfg.strategy == "beam":
        out = beam_search(
            model,
            None,
            cfg.max_new_tokens,
            num_beams=cfg.num_beams,
            length_penalty=cfg.length_penalty,
            early_stopping=cfg.early_stopping,
            eos_token_id=eos,
            pad_token_id=pad,
            all_finished=all_finished,
            encoder_input_ids=batch["input_ids"],
            encoder_attention_mask=batch["attention_mask"],
        )
        return out.sequences[:, 1:]
    tokens = generate(
        model,
        None,
        cfg.max_new_tokens,
        greedy=cfg.strategy == "greedy",
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        eos_token_id=eos,
        pad_token_id=pad,
        all_finished=all_finished,
        encoder_input_ids=batch["input_ids"],
        encoder_attention_mask=batch["attention_mask"],
    )
    return tokens[:, 1:]
