"""Autoregressive generation with the KV cache: greedy, temperature, top-k and top-p (nucleus) sampling.

One prefill forward over the prompt fills the cache (and, for encoder-decoder models, encodes the source and
projects its keys/values once); every later step feeds only the newest token. Token choice is a separate pure
function of the last logits (:func:`next_token`), so other search strategies (beam search) can reuse
:func:`pretrain.models.transformer.KVCache` and the step loop. The cache and the output are allocated at their
final length (prompt + ``max_new_tokens``) and written in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from pretrain.errors import InputError
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


class DecodingConfig(Protocol):
    """What decoding reads of a model's configuration (``ModelConfig``, ``Seq2SeqConfig``)."""

    @property
    def arch(self) -> str: ...
    @property
    def lm_head(self) -> bool: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def decoder_start_token_id(self) -> int | None: ...


class Decodable(Protocol):
    """A model :func:`generate` and ``beam_search`` run: a :class:`Transformer` with an LM head, or the RNN
    encoder-decoder baseline (``pretrain.models.rnn.Seq2SeqRNN``); called with the Transformer's keyword
    arguments (``use_cache``, ``cache``, ``position_ids``, ...), it returns an output with ``logits`` and ``cache``."""

    @property
    def config(self) -> DecodingConfig: ...
    @property
    def training(self) -> bool: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def next_token(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Choose one token per row of logits (B, V) -> (B,).

    greedy: argmax. Otherwise sample from softmax(logits / temperature) restricted to the top_k most likely
    tokens and to the smallest set of most likely tokens whose probability reaches top_p (Holtzman et al. 2020).
    """
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    ids = None  # vocabulary id of each column of logits; None: all V in order
    if top_k is not None and top_k < logits.shape[-1]:
        logits, ids = logits.topk(top_k, dim=-1)  # (B, k), most likely first: top_p sorts k, not V
    if top_p is not None and top_p < 1.0:
        if ids is None:
            logits, ids = logits.sort(dim=-1, descending=True)
        probs = logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before already reach top_p
        logits = logits.masked_fill(drop, float("-inf"))
    choice = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
    return (choice if ids is None else ids.gather(1, choice)).squeeze(1)


def last_positions(input_ids: Tensor) -> Tensor:
    """(B,) flat indices of each row's last position in input_ids (B, P): the prefill's ``target_positions``,
    so the LM head runs on the one position per row whose logits choose the next token."""
    B, P = input_ids.shape
    return torch.arange(1, B + 1, device=input_ids.device) * P - 1


def _check_args(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, greedy: bool
) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


@torch.no_grad()
def generate(
    model: Decodable,
    input_ids: Tensor | None,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    encoder_input_ids: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    all_finished: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """Extend ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens -> (B, T + n).

    Decoder-only: ``input_ids`` is the prompt, left-padded where ``attention_mask`` (B, T) is 0 (positions then
    count real tokens only). Encoder-decoder: ``encoder_input_ids`` (B, S) (+ ``encoder_attention_mask``) is the
    source and ``input_ids`` the decoder prefix (default: one ``decoder_start_token_id``). A row stops at
    ``eos_token_id`` (default ``config.eos_token_id``) and is filled with ``pad_token_id`` (default: config pad,
    else eos) afterwards; generation ends when every row has stopped. ``generator`` (on the model's device) makes
    sampling reproducible. The model runs in eval mode; its training flag is restored afterwards.
    ``all_finished(finished)`` ((B,) bool -> bool, default ``finished.all()``) decides when generation ends:
    data-parallel ranks of a sharded model pass an all-reduce, so that every rank runs the same forward passes.
    """
    cfg = model.config
    _check_args(max_new_tokens, temperature, top_k, top_p, greedy)
    if cfg.arch == "encoder" or not cfg.lm_head:
        raise ValueError("generate needs arch 'decoder' or 'encoder-decoder' with an LM head")
    enc_dec = cfg.arch == "encoder-decoder"
    if enc_dec:
        if encoder_input_ids is None:
            raise ValueError("encoder_input_ids (B, S) is required for an encoder-decoder model")
        if input_ids is None:
            if cfg.decoder_start_token_id is None:
                raise ValueError("pass input_ids or set ModelConfig.decoder_start_token_id")
            input_ids = encoder_input_ids.new_full(
                (encoder_input_ids.shape[0], 1), cfg.decoder_start_token_id
            )
    elif input_ids is None:
        raise ValueError("input_ids (B, T) prompt is required for a decoder-only model")
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    pad = next((t for t in (pad_token_id, cfg.pad_token_id, eos) if t is not None), 0)

    if enc_dec:
        inputs = {
            "input_ids": encoder_input_ids,
            "attention_mask": encoder_attention_mask,
            "decoder_input_ids": input_ids,
        }
        positions = None
    else:
        positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions}

    was_training = model.training
    model.eval()
    B, P = input_ids.shape
    tokens = input_ids.new_full((B, P + max_new_tokens), pad)
    tokens[:, :P] = input_ids
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    length = P
    try:
        out = model(**inputs, use_cache=True, target_positions=last_positions(input_ids))
        out.cache.capacity = P + max_new_tokens  # the next step allocates the cache's final size once
        logits = out.logits  # (B, V)
        for step in range(max_new_tokens):
            new = next_token(
                logits,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                greedy=greedy,
                generator=generator,
            )
            if eos is not None:
                new = new.masked_fill(finished, pad)
                finished = finished | (new == eos)
            tokens[:, length] = new
            length += 1
            done = bool(finished.all()) if all_finished is None else all_finished(finished)
            if step == max_new_tokens - 1 or done:
                break
            if positions is not None:
                positions = positions[:, -1:] + 1
            key = "decoder_input_ids" if enc_dec else "input_ids"
            out = model(**{key: new[:, None]}, position_ids=positions, cache=out.cache, use_cache=True)
            logits = out.logits[:, -1]
    finally:
        model.train(was_training)
    return tokens[:, :length]


DEFAULT_NEW_TOKENS = 100


def sample_texts(
    model: Transformer,
    tokenizer: Any,
    prompt: str,
    *,
    num_samples: int = 1,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos: str = "</s>",
    seed: int = 0,
) -> list[str]:
    """``num_samples`` texts of ``model`` (decoder or encoder-decoder with an LM head) for ``prompt`` (a
    ``tokenizers.Tokenizer`` encodes it; a prompt spelling ``</s>`` is that text, not EOS): a decoder's are the
    prompt and its continuation, an encoder-decoder's the spans its sentinels stand for. ``max_new_tokens``:
    default 100, or what the position table leaves; ``eos``: the stop token ('' never stops early)."""
    from pretrain.datamodules.tokenizer import TextEncoder

    cfg = model.config
    ids = torch.tensor([TextEncoder(tokenizer).encode(prompt)] * num_samples, dtype=torch.long)
    if ids.shape[1] == 0 and cfg.arch == "decoder":
        raise InputError("the prompt is empty; pass --prompt TEXT")
    new_tokens = _max_new_tokens(cfg, ids.shape[1], max_new_tokens)
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos and eos_id is None:
        raise InputError(f"--eos {eos!r} is not in the tokenizer's vocabulary; name one that is, or --eos ''")
    enc_dec = cfg.arch == "encoder-decoder"
    out = generate(
        model.eval(),
        None if enc_dec else ids,
        new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        eos_token_id=eos_id,
        generator=torch.Generator().manual_seed(seed),
        encoder_input_ids=ids if enc_dec else None,
    )
    if enc_dec:
        return [tokenizer.decode(row, skip_special_tokens=False) for row in out.tolist()]
    return [prompt + tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out.tolist()]


def span_filling_note(tokenizer: Any, prompt: str) -> str:
    """What an encoder-decoder (span corruption) model's output is, and a warning for a prompt with no sentinel."""
    from pretrain.datamodules.tokenizer import TextEncoder

    prompt_ids = TextEncoder(tokenizer).encode(prompt)
    note = (
        "(a span-corruption model returns the spans its input's sentinels stand for, each after its sentinel: "
        "<extra_id_0> span <extra_id_1> span ...)"
    )
    if not any((tokenizer.id_to_token(i) or "").startswith("<extra_id_") for i in prompt_ids):
        note += (
            "\n(the prompt has no sentinel, so there is nothing to fill: mark missing text with <extra_id_0>, "
            'e.g. --prompt "To be, or <extra_id_0> to be")'
        )
    return note


def _max_new_tokens(cfg: ModelConfig, prompt_len: int, requested: int | None) -> int:
    """``--max-new-tokens`` (default: 100, or what the position table leaves). A model with a position table
    (learned / sinusoidal) cannot go past ``max_seq_len``: say so before generating instead of failing after."""
    if cfg.position not in ("learned", "sinusoidal"):
        return requested or DEFAULT_NEW_TOKENS
    limit = cfg.max_seq_len
    room = limit - 1 if cfg.arch == "encoder-decoder" else limit - prompt_len
    max_new_tokens = requested or min(DEFAULT_NEW_TOKENS, max(room, 1))
    if cfg.arch == "encoder-decoder":
        if prompt_len > limit or max_new_tokens + 1 > limit:
            raise InputError(
                f"the prompt ({prompt_len} tokens) or --max-new-tokens {max_new_tokens} exceeds the model's "
                f"{limit} positions; shorten the prompt or use --max-new-tokens {limit - 1}"
            )
    elif prompt_len + max_new_tokens > limit:
        raise InputError(
            f"the prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's {limit} "
            f"positions (model.max_seq_len); use --max-new-tokens {max(limit - prompt_len, 0)} or a shorter prompt"
        )
    return max_new_tokens
