"""Turn our ``Transformer`` (or a checkpoint of one) into an ``LMScorer``.

Checkpoints accepted by ``load_model_and_tokenizer``:

- a ``pretrain fit`` checkpoint file (``.ckpt``; config, weights and tokenizer in one file), or a run /
  checkpoint directory (its newest valid ``.ckpt``);
- a transformers directory (``config.json`` + weights, e.g. written by ``pretrain.models.hf.save_hf``) of a
  GPT-2, Llama or T5 model, converted with ``pretrain.models.hf.from_hf``; the tokenizer is read from the same
  directory unless given.

The prefix token (conditioning an empty context, and the first rolling-perplexity window) is, as in
lm-eval, the tokenizer's BOS when a transformers directory declares one, else EOS (the document separator
our models are trained with); ``prefix_token`` overrides it. An encoder-only (BERT-style) model is scored by
pseudo-log-likelihood (``scoring``) with its tokenizer's mask / cls / sep tokens (the run's
``tokenizer.special_tokens`` overrides, or a transformers directory's ``mask_token`` ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pretrain.datamodules.special_tokens import special_token_id
from pretrain.datamodules.tokenizer import load_tokenizer, resolve_eos
from pretrain.errors import InputError
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

from .scoring import DecodeFn, DecodeSteps, LMScorer, LogitsFn, UnsupportedModelError, check_architecture

HF_SPECIAL_KEYS = {f"{role}_token": role for role in ("bos", "eos", "mask", "cls", "sep")}  # key -> role
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real ones: (B, T) mask -> (B, T) ids (0 on left padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def transformer_logits_fn(model: Transformer) -> LogitsFn:
    """``LMScorer.logits_fn`` for our backbone (positions rebuilt from the mask: padding is inert)."""
    if model.config.arch == "encoder-decoder":

        def seq2seq(ids, mask, dec_ids, dec_mask):
            return model(
                input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask
            ).logits

        return seq2seq

    def causal(ids, mask):
        return model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits

    return causal


def transformer_packed_logits_fn(model: Transformer) -> LogitsFn:
    """``LMScorer.packed_logits_fn`` for our backbone: rows of packed requests, kept apart by document ids
    (document id -1 = a leftover slot, masked)."""
    if model.config.arch == "encoder-decoder":

        def seq2seq(ids, docs, positions, dec_ids, dec_docs, dec_positions):
            return model(
                input_ids=ids,
                attention_mask=(docs >= 0).long(),
                document_ids=docs,
                position_ids=positions,
                decoder_input_ids=dec_ids,
                decoder_attention_mask=(dec_docs >= 0).long(),
                decoder_document_ids=dec_docs,
                decoder_position_ids=dec_positions,
            ).logits

        return seq2seq

    def packed(ids, docs, positions):
        return model(
            input_ids=ids, attention_mask=(docs >= 0).long(), document_ids=docs, position_ids=positions
        ).logits

    return packed


def transformer_decode_fn(model: Transformer) -> DecodeFn:
    """Incremental greedy decoding with the backbone's KV cache (one prefill, then one token per step)."""
    cfg = model.config

    def steps(ids: torch.Tensor, mask: torch.Tensor) -> DecodeSteps:
        if cfg.arch == "encoder-decoder":
            start = torch.full(
                (ids.shape[0], 1), cfg.decoder_start_token_id or 0, dtype=torch.long, device=ids.device
            )
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start, use_cache=True)
            while True:
                new = yield out.logits[:, -1]
                out = model(decoder_input_ids=new[:, None], cache=out.cache, use_cache=True)
        pos = positions_from_mask(mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        while True:
            new = yield out.logits[:, -1]
            pos = pos[:, -1:] + 1
            out = model(input_ids=new[:, None], position_ids=pos, cache=out.cache, use_cache=True)

    return steps


def scorer_from_model(
    model: Transformer,
    tokenizer: Tokenizer,
    *,
    prefix_token: str | None = None,
    eos_token: str | None = None,
    max_length: int | None = None,
    batch_size: int = 16,
    padding_side: str = "right",
    special_tokens: dict[str, str] | None = None,
    eval_mode: bool = True,
    unpadded: bool = True,
) -> LMScorer:
    """An ``LMScorer`` over ``model`` (put in eval mode unless ``eval_mode=False``: a caller that trains it
    switches modes itself); special tokens are looked up by name (``special_tokens``: role -> token).
    ``unpadded``: score requests packed into rows without padding (``scoring``; the same log-likelihoods)."""
    cfg: ModelConfig = model.config
    check_architecture(cfg.arch)
    if not cfg.lm_head:
        raise UnsupportedModelError(
            "the model has no LM head (lm_head=False); in-context evaluation needs logits"
        )
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > cfg.vocab_size:
        raise InputError(
            f"the tokenizer has {vocab} tokens but the model only {cfg.vocab_size}: wrong tokenizer?"
        )
    _, eos_id = resolve_eos(tokenizer, eos_token)
    prefix_id = eos_id if prefix_token is None else _token_id(tokenizer, prefix_token)
    encoder = {}
    if cfg.arch == "encoder":
        encoder = {
            f"{role}_token_id": special_token_id(tokenizer, role, special_tokens)
            for role in ("mask", "cls", "sep")
        }
    if eval_mode:
        model.eval()
    return LMScorer(
        logits_fn=transformer_logits_fn(model),
        tokenizer=tokenizer,
        max_length=max_length or cfg.max_seq_len,
        prefix_token_id=prefix_id,
        eos_token_id=eos_id,
        arch=cfg.arch,
        decoder_start_token_id=(cfg.decoder_start_token_id or 0) if cfg.arch == "encoder-decoder" else None,
        pad_token_id=cfg.pad_token_id or 0,
        batch_size=batch_size,
        padding_side=padding_side,
        device=next(model.parameters()).device,
        decode_fn=None if cfg.arch == "encoder" else transformer_decode_fn(model),
        packed_logits_fn=transformer_packed_logits_fn(model) if unpadded else None,
        **encoder,
    )


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise InputError(f"token {token!r} is not in the tokenizer's vocabulary")
    return token_id


def _hf_special_tokens(directory: Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``mask_token``, ... declared by a transformers tokenizer directory."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            for key in HF_SPECIAL_KEYS:
                value = data.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str) and key not in found:
                    found[key] = value
    return found


def _load_hf_dir(path: Path, tokenizer: str | Path | None) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    import transformers

    from pretrain.models.hf import check_export, from_hf

    check_export(path)  # a half-written export is named as one, not half-read
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    arch = (config.get("architectures") or [""])[0]
    if not hasattr(transformers, arch):
        raise InputError(
            f"{path}/config.json names architecture {arch!r}, which transformers does not provide"
        )
    model = from_hf(getattr(transformers, arch).from_pretrained(path, use_safetensors=True))  # no unpickling
    tok_path = Path(tokenizer or path)
    specials = _hf_special_tokens(tok_path if tok_path.is_dir() else tok_path.parent)
    prefix = specials.get("bos_token") or specials.get("eos_token")
    roles = {HF_SPECIAL_KEYS[key]: token for key, token in specials.items()}
    info = {"prefix_token": prefix, "eos_token": specials.get("eos_token"), "special_tokens": roles}
    return model, load_tokenizer(tok_path), info


def _load_ckpt(path: Path, tokenizer: str | Path | None) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    from pretrain.checkpoint.convert import load_model as load_checkpoint

    model, payload, tok = load_checkpoint(path)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    if tok is None:
        raise InputError(
            f"{path} carries no tokenizer; pass --tokenizer PATH (the tokenizer.json it was trained with)"
        )
    overrides = (payload["config"].get("tokenizer") or {}).get("special_tokens") or {}
    return model, tok, {"prefix_token": None, "eos_token": overrides.get("eos"), "special_tokens": overrides}


def load_model_and_tokenizer(
    checkpoint: str | Path, tokenizer: str | Path | None = None
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """(model, tokenizer, {"prefix_token", "eos_token", "special_tokens"}) from a .ckpt / run dir /
    transformers dir."""
    from pretrain.checkpoint.resume import find_resume, is_valid

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_file() or is_valid(path):
        return _load_ckpt(path, tokenizer)
    if (path / "config.json").is_file():
        return _load_hf_dir(path, tokenizer)
    for directory in (path, path / "checkpoints"):
        found = find_resume(directory)
        if found is not None:
            return _load_ckpt(found, tokenizer)
    raise FileNotFoundError(
        f"{path} holds no checkpoint: neither .ckpt files (in it or checkpoints/) nor config.json"
    )


def load_scorer(
    checkpoint: str | Path,
    tokenizer: str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    prefix_token: str | None = None,
    **scorer_options: Any,
) -> LMScorer:
    """``load_model_and_tokenizer`` + ``scorer_from_model`` on ``device`` in ``dtype`` (float32 | bfloat16 | float16)."""
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model, tok, info = load_model_and_tokenizer(checkpoint, tokenizer)
    model = model.to(device=device, dtype=DTYPES[dtype])
    return scorer_from_model(
        model,
        tok,
        prefix_token=prefix_token or info["prefix_token"],
        eos_token=info["eos_token"],
        special_tokens=info["special_tokens"],
        **scorer_options,
    )
