"""Beam search with length normalisation on the KV cache, step for step the algorithm of transformers' ``generate``
(``num_beams=k``, ``length_penalty``, ``early_stopping``; ``GenerationMixin._beam_search`` in transformers 5).

Axes: B batch, K beams, V vocabulary, P prompt length (decoder side), L = P + max_new_tokens. Every step:

1. candidates: the 2K best (beam, token) continuations by accumulated log-probability
   ``s(y_1..t) = sum_i log p(y_i | y_<i)`` (K beams x V tokens; at the first step only beam 0 is live);
2. a candidate is *done* when its token is EOS or the sequence reaches L tokens;
3. the K best candidates that are not done become the running beams (the cache is reordered to them);
4. done candidates among the top K of the 2K enter the finished pool with the normalised score
   ``s / n ** length_penalty`` (n = generated tokens, EOS included); the pool keeps its K best;
5. stop when no running beam can still beat the pool's worst hypothesis (``early_stopping=False``: estimated at the
   current length; ``"never"``: at L when length_penalty > 0), when every pool is full (``early_stopping=True``),
   or when every candidate is done. ``all_finished`` lets data-parallel ranks of a sharded model (FSDP2, ZeRO-3)
   agree on that stop, so that every rank runs the same forwards: a rank whose rows have stopped keeps stepping,
   which changes nothing (no running beam can enter a full pool: every new candidate scores ``NEG``).

The result is the pool's best hypotheses, padded to the longest returned one with ``pad_token_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pretrain.models.generation import Decodable, last_positions

NEG = -1.0e9  # score of excluded candidates (transformers uses the same constant)


@dataclass
class BeamSearchOutput:
    sequences: Tensor  # (B * R, P + n): prompt + best hypotheses, R = num_return_sequences per input
    scores: Tensor  # (B * R,) length-normalised log-probability of each returned hypothesis


def _decoding_inputs(
    model: Decodable,
    input_ids: Tensor | None,
    attention_mask: Tensor | None,
    encoder_input_ids: Tensor | None,
    encoder_attention_mask: Tensor | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
) -> tuple[dict[str, Tensor | None], Tensor, Tensor | None, int | None, int]:
    """Prefill inputs, decoder prompt (B, P), prompt positions (decoder-only with padding) or None, eos, pad --
    the conventions of :func:`pretrain.models.generation.generate`."""
    cfg = model.config
    if cfg.arch == "encoder" or not cfg.lm_head:
        raise ValueError("beam search needs arch 'decoder' or 'encoder-decoder' with an LM head")
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    pad = next((t for t in (pad_token_id, cfg.pad_token_id, eos) if t is not None), 0)
    if cfg.arch == "decoder":
        if input_ids is None:
            raise ValueError("input_ids (B, T) prompt is required for a decoder-only model")
        positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return (
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions},
            input_ids,
            positions,
            eos,
            pad,
        )
    if encoder_input_ids is None:
        raise ValueError("encoder_input_ids (B, S) is required for an encoder-decoder model")
    if input_ids is None:
        if cfg.decoder_start_token_id is None:
            raise ValueError("pass input_ids or set ModelConfig.decoder_start_token_id")
        input_ids = encoder_input_ids.new_full((encoder_input_ids.shape[0], 1), cfg.decoder_start_token_id)
    inputs = {
        "input_ids": encoder_input_ids,
        "attention_mask": encoder_attention_mask,
        "decoder_input_ids": input_ids,
    }
    return inputs, input_ids, None, eos, pad


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """t (B, N, ...) rows index (B, M) -> (B, M, ...)."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return t.take_along_dim(index, dim=1)


@torch.no_grad()
def beam_search(
    model: Decodable,
    input_ids: Tensor | None,
    max_new_tokens: int,
    *,
    num_beams: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    encoder_input_ids: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    all_finished: Callable[[Tensor], bool] | None = None,
) -> BeamSearchOutput:
    """Beam search from ``input_ids`` (decoder-only prompt, left-padded where ``attention_mask`` is 0) or from
    ``encoder_input_ids`` (encoder-decoder; ``input_ids`` = decoder prefix, default the start token).

    ``early_stopping``: False (transformers' default heuristic), True (stop once K hypotheses are finished) or
    ``"never"`` (the canonical stopping rule). EOS defaults to ``config.eos_token_id``, padding to the config's
    pad token, else EOS. ``all_finished(stop)`` (a 0-dim bool: this batch's stopping rule holds -> bool, default
    ``bool(stop)``) decides when the search ends: sharded data-parallel ranks pass an all-reduce.
    """
    if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"need num_beams >= 1 and 1 <= num_return_sequences <= num_beams, got {num_beams}, {num_return_sequences}"
        )
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    inputs, prompt, positions, eos, pad = _decoding_inputs(
        model,
        input_ids,
        attention_mask,
        encoder_input_ids,
        encoder_attention_mask,
        eos_token_id,
        pad_token_id,
    )
    B, P = prompt.shape
    K, L = num_beams, prompt.shape[1] + max_new_tokens
    device = prompt.device
    was_training = model.training
    model.eval()
    try:
        out = model(**inputs, use_cache=True, target_positions=last_positions(prompt))
        cache = out.cache
        expand = torch.arange(B, device=device).repeat_interleave(K)  # row b -> its K beams, (B*K,)
        cache.reorder(expand)  # a KVCache, or a recurrent model's state (pretrain.models.rnn.RNNState)
        cache.capacity = L  # the next step allocates the KV cache's final size once
        logits = out.logits.index_select(0, expand)  # (B*K, V)
        if positions is not None:
            positions = positions[:, -1:].index_select(0, expand)
        V = logits.shape[-1]

        running = torch.full((B, K, L), pad, dtype=torch.long, device=device)
        running[:, :, :P] = prompt[:, None]
        running_scores = torch.full((B, K), NEG, device=device)
        running_scores[:, 0] = 0.0  # all beams start identical: expand beam 0 only
        finished = running.clone()
        finished_scores = torch.full((B, K), NEG, device=device)
        finished_lengths = torch.zeros((B, K), dtype=torch.long, device=device)
        is_finished = torch.zeros((B, K), dtype=torch.bool, device=device)
        improvable = torch.ones((B, 1), dtype=torch.bool, device=device)
        top_k_mask = torch.arange(2 * K, device=device) < K  # only the top K candidates may finish
        batch_offset = torch.arange(B, device=device)[:, None] * K

        for cur_len in range(P, L):
            log_probs = torch.log_softmax(logits.float(), dim=-1).view(B, K, V) + running_scores[..., None]
            scores, flat = log_probs.view(B, K * V).topk(2 * K, dim=1)  # (B, 2K), descending
            origin, token = flat // V, flat % V
            candidates = _gather(running, origin)
            candidates[:, :, cur_len] = token
            done = torch.full_like(token, cur_len + 1 >= L, dtype=torch.bool)
            if eos is not None:
                done |= token == eos

            # running beams: the K best candidates that are not done
            alive_scores = scores + done.float() * NEG
            keep = alive_scores.topk(K, dim=1).indices
            running, running_scores = _gather(candidates, keep), _gather(alive_scores, keep)
            beam_origin = _gather(origin, keep)

            # finished pool: merge the newly done top-K candidates, keep the K best by normalised score
            length = cur_len + 1 - P
            new_scores = scores / length**length_penalty
            pool_full = is_finished.all(dim=1, keepdim=True) & (early_stopping is True)
            new_done = done & top_k_mask
            new_scores = new_scores + (pool_full | ~improvable | ~new_done).float() * NEG
            merged_scores = torch.cat([finished_scores, new_scores], dim=1)
            best = merged_scores.topk(K, dim=1).indices
            finished = _gather(torch.cat([finished, candidates], dim=1), best)
            finished_scores = _gather(merged_scores, best)
            finished_lengths = _gather(
                torch.cat([finished_lengths, torch.full_like(token, length)], dim=1), best
            )
            is_finished = _gather(torch.cat([is_finished, new_done], dim=1), best)

            # can a running beam still beat the worst finished hypothesis?
            hypothetical = (L if early_stopping == "never" and length_penalty > 0 else cur_len + 1) - P
            best_running = running_scores[:, :1] / hypothetical**length_penalty
            worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, NEG)
            improvable = improvable & (best_running > worst).any(dim=1, keepdim=True)
            all_pools_full = is_finished.all() & (early_stopping is True)
            stop = ~improvable.any() | all_pools_full | done.all()
            if bool(stop) if all_finished is None else all_finished(stop):
                break

            cache.reorder((beam_origin + batch_offset).flatten(), beams_only=True)
            new_tokens = running[:, :, cur_len].reshape(B * K, 1)
            if positions is not None:
                positions = positions + 1
            key = "decoder_input_ids" if model.config.arch == "encoder-decoder" else "input_ids"
            logits = model(**{key: new_tokens}, position_ids=positions, cache=cache, use_cache=True).logits[
                :, -1
            ]
    finally:
        model.train(was_training)

    R = num_return_sequences
    lengths = finished_lengths[:, :R]
    width = P + int(lengths.max())
    sequences = finished[:, :R, :width].reshape(B * R, width)  # positions past a hypothesis' end hold pad
    return BeamSearchOutput(sequences, finished_scores[:, :R].reshape(B * R))
