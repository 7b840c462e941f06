"""One transformer backbone for GPT (decoder), BERT (encoder) and T5 (encoder-decoder).

Axes: B batch, T query length, S key length (past + T, or encoder length for cross-attention), d model width,
h query heads, g key/value heads, d_h head width, V vocabulary. Every block is

    pre-norm:  x = x + drop(f(norm(x)))        (GPT-2, T5, Llama; each stack ends with a final norm)
    post-norm: x = norm(x + drop(f(x)))        (BERT)

with f = self-attention, then cross-attention (encoder-decoder decoder only), then the MLP. Attention runs on
(B, h, T, d_h) tensors through ``pretrain.models.attention``: each stack builds one :class:`AttentionMask` (causal,
key padding, packed documents, prefix-LM, sparse window / global / random blocks, T5 bias) shared by its layers
(a second one for local layers, ModernBERT's alternation), computed by SDPA (dense mask) or flex_attention (block
mask + score_mod) as ``config.attention`` says. A pre-norm stack after a normed embedding (ModernBERT) has no
attention norm in its first block: its input is normed already. RoPE and its scalings: ``pretrain.models.rope``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pretrain.models.attention import (
    AttentionMask,
    MaskInputs,
    ScoreMod,
    SparsePattern,
    attend,
    random_block_table,
)
from pretrain.models.config import ModelConfig
from pretrain.models.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from pretrain.parallel.context import ContextParallel


def relu_squared(x: Tensor) -> Tensor:
    """relu(x)^2 (So et al. 2021, "Primer"; modded-nanogpt)."""
    return F.relu(x).square()


ACT_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "relu2": relu_squared,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "swiglu": F.silu,
    "geglu": F.gelu,
    "geglu_tanh": partial(F.gelu, approximate="tanh"),
    "reglu": F.relu,
}


@dataclass
class ModelOutput:
    logits: Tensor | None  # (B, T, V), or (N, V) at ``target_positions``; None without an LM head
    hidden_states: Tensor  # (B, T, d) after the final norm; decoder side for encoder-decoder
    encoder_hidden_states: Tensor | None = None  # (B, S, d) encoder-decoder (None when taken from cache)
    pooled_output: Tensor | None = None  # (B, d) with config.pooler
    cache: KVCache | None = None


class KVCache:
    """Keys and values of past positions for incremental decoding (one entry per decoder layer).

    ``self_kv[i]``: (k, v) of self-attention over the S positions so far, each (B, g, S, d_h): views into buffers
    (B, g, capacity, d_h) allocated once and written in place by every call (no per-step concatenation); a call
    that overflows them reallocates with twice the length (amortised O(1) per position). ``capacity``: positions
    to allocate up front (generation passes prompt + new tokens). ``cross_kv[i]``: (k, v) over the encoder
    output, each (B, g, S_enc, d_h), computed on the first call only. ``key_mask``: (B, S) bool, True = real past
    token (None = no padding so far); ``encoder_mask``: (B, S_enc).
    """

    def __init__(self, n_layer: int, capacity: int | None = None) -> None:
        self.self_kv: list[tuple[Tensor, Tensor] | None] = [None] * n_layer
        self.cross_kv: list[tuple[Tensor, Tensor] | None] = [None] * n_layer
        self.key_mask: Tensor | None = None
        self.encoder_mask: Tensor | None = None
        self.capacity = capacity
        self._buffers: list[tuple[Tensor, Tensor] | None] = [None] * n_layer
        self._spares: list[tuple[Tensor, Tensor] | None] = [
            None
        ] * n_layer  # reorder() writes here, then swaps

    @property
    def seq_len(self) -> int:
        """Number of cached positions S_past."""
        return 0 if self.self_kv[0] is None else self.self_kv[0][0].shape[2]

    @property
    def has_encoder(self) -> bool:
        return self.cross_kv[0] is not None

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this call's (B, g, T, d_h) keys/values after the cached ones; return all of them (B, g, S, d_h)."""
        past = self.self_kv[layer]
        start = 0 if past is None else past[0].shape[2]
        end = start + k.shape[2]
        buffers = self._buffers[layer]
        if buffers is None or buffers[0].shape[2] < end:
            size = max(end, self.capacity or 0, 2 * start)
            buffers = (
                k.new_empty(*k.shape[:2], size, k.shape[3]),
                v.new_empty(*v.shape[:2], size, v.shape[3]),
            )
            if past is not None:
                for buffer, old in zip(buffers, past, strict=True):
                    buffer[:, :, :start] = old
            self._buffers[layer], self._spares[layer] = buffers, None
        buffers[0][:, :, start:end] = k
        buffers[1][:, :, start:end] = v
        kv = (buffers[0][:, :, :end], buffers[1][:, :, :end])
        self.self_kv[layer] = kv
        return kv

    def extend_mask(self, mask: Tensor | None, batch: int, length: int) -> Tensor | None:
        """Key padding mask over past + current positions (B, S), or None if nothing was ever padded."""
        known = mask if mask is not None else self.key_mask
        if known is None:
            return None
        ones = partial(torch.ones, dtype=torch.bool, device=known.device)
        old = self.key_mask if self.key_mask is not None else ones(batch, self.seq_len)
        new = mask.bool() if mask is not None else ones(batch, length)
        self.key_mask = torch.cat([old, new], dim=1)
        return self.key_mask

    def reorder(self, index: Tensor, beams_only: bool = False) -> None:
        """Keep rows ``index`` (B',) of the cache: beam expansion (B' != B: new tensors) or beam reordering
        (B' = B: the cached positions are gathered into a second set of buffers in one copy, and the two swap).
        ``beams_only``: ``index`` only permutes the beams of each input, so what they share -- encoder keys/values
        and mask, the prompt's padding mask -- is left as it is."""

        def rows(pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            return pair[0].index_select(0, index), pair[1].index_select(0, index)

        for i, pair in enumerate(self.self_kv):
            if pair is None:
                continue
            buffers = self._buffers[i]
            if buffers is None or len(index) != pair[0].shape[0] or pair[0].requires_grad:
                self.self_kv[i] = rows(pair)
                self._buffers[i] = self._spares[i] = None  # the next extend() allocates new buffers
                continue
            spares = self._spares[i] or (torch.empty_like(buffers[0]), torch.empty_like(buffers[1]))
            S = pair[0].shape[2]
            for old, new in zip(pair, spares, strict=True):
                torch.index_select(old, 0, index, out=new[:, :, :S])
            self._buffers[i], self._spares[i] = spares, buffers
            self.self_kv[i] = (spares[0][:, :, :S], spares[1][:, :, :S])
        if beams_only:
            return
        self.cross_kv = [None if kv is None else rows(kv) for kv in self.cross_kv]
        if self.encoder_mask is not None:
            self.encoder_mask = self.encoder_mask.index_select(0, index)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, index)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.norm_bias)


def relative_position_bucket(
    relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5 buckets for relative = key_pos - query_pos: exact below num_buckets/2 (per direction), log-spaced up to
    max_distance, clipped beyond (Raffel et al. 2020; mesh-tensorflow ``_relative_position_bucket``)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # only the past is visible
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """T5 bias b[h, bucket(k - q)] added to the attention logits; one table per stack, shared by its layers."""

    def __init__(self, config: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_num_buckets
        self.max_distance = config.relative_max_distance
        self.embedding = nn.Embedding(config.relative_num_buckets, config.n_head)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q_pos (B|1, T), k_pos (B|1, S) -> bias (B|1, h, T, S)."""
        relative = k_pos[:, None, :] - q_pos[:, :, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(buckets).permute(0, 3, 1, 2)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, batch: int) -> ScoreMod:
        """The same bias as a flex_attention ``score_mod``: score + b[h, bucket(k_pos - q_pos)]."""
        q_pos, k_pos, table = q_pos.expand(batch, -1), k_pos.expand(batch, -1), self.embedding.weight
        if hasattr(
            table, "to_local"
        ):  # a tensor-parallel rank's heads (a DTensor sharded by heads): h is local
            table = table.to_local()
        args = (self.bidirectional, self.num_buckets, self.max_distance)

        def add_bias(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return score + table[relative_position_bucket(k_pos[b, k] - q_pos[b, q], *args), h]

        return add_bias


def sinusoid_table(length: int, dim: int) -> Tensor:
    """(length, dim): [p, 2i] = sin(p / 10000^(2i/dim)), [p, 2i+1] = cos(same) (Vaswani et al. 2017)."""
    angles = torch.arange(length, dtype=torch.float)[:, None] * torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float) * (-math.log(10000.0) / dim)
    )
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)


class Embeddings(nn.Module):
    """Token (+ segment) (+ absolute position) embeddings, optional norm (BERT), dropout: (B, T) -> (B, T, d)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model) if config.position == "learned" else None
        if config.position == "sinusoidal":
            self.register_buffer(
                "sinusoid", sinusoid_table(config.max_seq_len, config.d_model), persistent=False
            )
        else:
            self.sinusoid = None
        self.segment = (
            nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        )
        self.norm = make_norm(config) if config.embedding_norm else None
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x = self.tok(input_ids)
        if self.segment is not None:  # BERT: missing token_type_ids mean segment 0
            segments = input_ids.new_zeros(()) if token_type_ids is None else token_type_ids  # () broadcasts
            x = x + self.segment(segments)
        if self.pos is not None:
            x = x + self.pos(positions)
        if self.sinusoid is not None:
            x = x + self.sinusoid[positions]
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


class Attention(nn.Module):
    """Multi-head attention with g <= h key/value heads (GQA): projections q, k, v (k, v of the encoder output for
    cross-attention) and out. Head counts are read from the projections' outputs, so a tensor-parallel rank whose
    q, k, v hold a slice of whole heads (``pretrain.parallel``) computes those heads with the same code."""

    def __init__(self, config: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        sizes = config.sizes
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, sizes.n_kv_head, sizes.head_dim
        q_dim, kv_dim = config.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.cross = cross
        self.q = nn.Linear(config.d_model, q_dim, bias=config.attn_bias)
        self.k = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.v = nn.Linear(config.d_model, kv_dim, bias=config.attn_bias)
        self.out = nn.Linear(q_dim, config.d_model, bias=config.attn_bias)
        # qk_norm: RMSNorm of every head's q and k over d_h (learned gain), before RoPE
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.scale = None if config.attn_scale == "default" else 1.0  # None: SDPA's 1/sqrt(d_h)
        if config.attn_scale == "default" and config.parametrization == "mup":
            # muP: a q k^T / d_h (Tensor Programs V, sec. 6), a = mup_attn_multiplier
            self.scale = config.mup_attn_multiplier / self.head_dim
        self.dropout = config.attn_dropout

    def _heads(self, projection: nn.Linear, x: Tensor) -> Tensor:
        """(B, T, d) -> (B, heads, T, d_h): ``projection(x)`` split into its heads."""
        return projection(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        memory: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """x (B, T, d) -> (B, T, d); mask None = every key visible. memory: encoder output (B, S, d) for
        cross-attention (unused once its k, v sit in ``cache``)."""
        q = self._heads(self.q, x)
        if self.q_norm is not None:
            q = self.q_norm(q)
        cached = cache.cross_kv[layer] if self.cross and cache is not None else None
        if cached is not None:
            k, v = cached
        else:
            source = memory if self.cross else x
            if source is None:
                raise ValueError("cross-attention needs memory (the encoder output) or its keys in the cache")
            k, v = self._heads(self.k, source), self._heads(self.v, source)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.cross and cache is not None:
                cache.cross_kv[layer] = (k, v)
        if not self.cross:
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            if cache is not None:
                k, v = cache.extend(layer, k, v)
        y = attend(q, k, v, mask, self.scale, self.dropout if self.training else 0.0)  # (B, h, T, d_h)
        return self.out(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """proj(act(fc(x))), or GLU (Shazeer 2020): proj(act(gate(x)) * fc(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d_ff = config.sizes.d_ff
        self.gate = nn.Linear(config.d_model, d_ff, bias=config.mlp_bias) if config.gated else None
        self.fc = nn.Linear(config.d_model, d_ff, bias=config.mlp_bias)
        self.proj = nn.Linear(d_ff, config.d_model, bias=config.mlp_bias)
        self.act = ACT_FNS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)  # (B, T, d_ff)
        if self.gate is not None:
            return self.proj(self.act(self.gate(x)) * h)
        return self.proj(self.act(h))


class Block(nn.Module):
    """Self-attention, optional cross-attention, MLP; each a residual branch with pre- or post-norm."""

    def __init__(self, config: ModelConfig, cross_attention: bool = False, first: bool = False) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        # pre-norm after a normed embedding (ModernBERT): the first block's input is normed already
        normed_input = first and self.pre_norm and config.embedding_norm
        self.norm1, self.attn = nn.Identity() if normed_input else make_norm(config), Attention(config)
        self.norm_cross: nn.Module | None = None
        self.cross_attn: Attention | None = None
        if cross_attention:
            self.norm_cross, self.cross_attn = make_norm(config), Attention(config, cross=True)
        self.norm2, self.mlp = make_norm(config), MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def _branch_in(self, x: Tensor, norm: nn.Module) -> Tensor:
        return norm(x) if self.pre_norm else x

    def _branch_out(self, x: Tensor, y: Tensor, norm: nn.Module) -> Tensor:
        x = x + self.drop(y)
        return x if self.pre_norm else norm(x)

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask | None,
        rope: tuple[Tensor, Tensor] | None,
        memory: Tensor | None,
        memory_mask: AttentionMask | None,
        cache: KVCache | None,
        layer: int,
    ) -> Tensor:
        """x (B, T, d) -> (B, T, d)."""
        y = self.attn(self._branch_in(x, self.norm1), mask, rope, cache=cache, layer=layer)
        x = self._branch_out(x, y, self.norm1)
        if self.cross_attn is not None and self.norm_cross is not None:
            y = self.cross_attn(
                self._branch_in(x, self.norm_cross), memory_mask, memory=memory, cache=cache, layer=layer
            )
            x = self._branch_out(x, y, self.norm_cross)
        return self._branch_out(x, self.mlp(self._branch_in(x, self.norm2)), self.norm2)


class Stack(nn.Module):
    """Embedded tokens (B, T, d) -> n blocks -> final norm (pre-norm) -> (B, T, d). The global layers share one
    mask and one RoPE table, the local layers (``config.local_layer``) another pair."""

    random_table: Tensor | None

    def __init__(self, config: ModelConfig, n_layer: int, causal: bool, cross_attention: bool) -> None:
        super().__init__()
        self.config, self.causal = config, causal
        self.pattern = SparsePattern.from_config(config, causal) if config.sparse else None
        random_table = None
        if self.pattern is not None and self.pattern.random_blocks:
            p = self.pattern
            random_table = random_block_table(p.min_blocks, p.random_blocks, p.seed, causal).clone()
        self.register_buffer("random_table", random_table, persistent=False)  # drawn once, moves with .to()
        self.block_masks: dict = {}  # flex BlockMasks that depend on shapes only, reused across steps
        self.blocks = nn.ModuleList(Block(config, cross_attention, first=i == 0) for i in range(n_layer))
        # local layers (ModernBERT, global every k layers): the same sparse pattern with their own window, and
        # their own RoPE base
        self.local = [config.local_layer(i) for i in range(n_layer)]
        self.local_pattern = None
        if any(self.local):
            base = self.pattern or SparsePattern.from_config(config, causal)
            self.local_pattern = dataclasses.replace(base, window=config.local_attention_window)
        self.norm = make_norm(config) if config.norm_position == "pre" else None
        self.rope = self.local_rope = None
        if config.position == "rope":
            head_dim, local_theta = config.sizes.head_dim, config.local_rope_theta
            self.rope = Rotary(head_dim, config.rope_theta, config.rope_scaling)
            if any(self.local) and local_theta is not None and local_theta != config.rope_theta:
                self.local_rope = Rotary(head_dim, local_theta, config.rope_scaling)
        self.relative_bias = (
            RelativePositionBias(config, bidirectional=not causal) if config.position == "relative" else None
        )
        self.context_parallel: ContextParallel | None = None  # set by pretrain.parallel.context

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        key_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        prefix_lengths: Tensor | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
        checkpointing: bool = False,
        global_ids: Tensor | None = None,
        prefix_keys: Tensor | None = None,
        memory_document_ids: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, d); positions (B|1, T); key_mask (B, T) 1 = real; memory (B, S_enc, d), memory_mask (B, S_enc);
        global_ids (B, T) True = global token (encoders); document_ids (B, T) and memory_document_ids (B, S_enc):
        packed documents (self- and cross-attention within a document); prefix_keys (B, T) True = in its
        document's bidirectional prefix (causal stacks). Under context parallelism (``self.context_parallel``)
        every per-token input holds this rank's positions of the sequence (``pretrain.parallel.context``); under
        sequence parallelism x holds a slice of the sequence, so T is read from ``positions``."""
        B, T = x.shape[0], positions.shape[1]
        past = 0
        cp = self.context_parallel
        if cache is not None:
            if cp is not None:
                raise ValueError("a KV cache (generation) runs without context parallelism")
            past = cache.seq_len
            key_mask = cache.extend_mask(key_mask, B, T)
        inputs = MaskInputs(
            T,
            past + T,
            past,
            self.causal,
            False,
            key_mask,
            document_ids,
            prefix_lengths,
            global_ids,
            self.pattern,
            self.random_table,
            prefix_keys,
        )
        if cp is not None:  # this rank's queries, every rank's keys
            inputs = cp.global_keys(inputs, x.device)
        gather = cp.gather_keys if cp is not None else None
        bias = None
        if self.relative_bias is not None:  # T5: bias b[h, bucket(k - q)] on the logits
            k_pos = positions if past == 0 else torch.arange(past + T, device=x.device)[None]
            k_pos = k_pos if cp is None else cp.gather_tokens(k_pos)
            bias = (
                partial(self.relative_bias, positions, k_pos),
                self.relative_bias.score_mod(positions, k_pos, B),
            )
        backend, dropout = self.config.attention, self.training and self.config.attn_dropout > 0
        mask = AttentionMask(inputs, backend, x, bias, self.block_masks, dropout, gather)
        rope = self.rope(positions) if self.rope is not None else None
        local_mask, local_rope = mask, rope
        if self.local_pattern is not None:
            local = dataclasses.replace(inputs, pattern=self.local_pattern)
            local_mask = AttentionMask(local, backend, x, bias, self.block_masks, dropout, gather)
            local_rope = self.local_rope(positions) if self.local_rope is not None else rope
        cross_mask = None  # padded encoder positions are never attended, nor other documents' positions
        if (
            memory_mask is not None
            or memory_document_ids is not None
            or (cp is not None and memory is not None)
        ):
            keys = next(t for t in (memory_mask, memory_document_ids, memory) if t is not None).shape[1]
            cross = MaskInputs(
                T,
                keys,
                cross=True,
                key_mask=memory_mask,
                document_ids=document_ids if memory_document_ids is not None else None,
                key_document_ids=memory_document_ids,
            )
            cross = cross if cp is None else cp.global_keys(cross, x.device)
            cross_mask = AttentionMask(cross, backend, x, dropout=dropout, gather=gather)
        for i, block in enumerate(self.blocks):
            layer_mask, layer_rope = (local_mask, local_rope) if self.local[i] else (mask, rope)
            args = (x, layer_mask, layer_rope, memory, cross_mask, cache, i)
            x = checkpoint(block, *args, use_reentrant=False) if checkpointing else block(*args)
        return self.norm(x) if self.norm is not None else x


class MLMTransform(nn.Module):
    """BERT prediction-head transform: norm(act(dense(x))), (B, T, d) -> (B, T, d)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model, bias=config.mlm_head_bias)
        self.act = ACT_FNS[config.activation]  # gated activations use their gate non-linearity
        self.norm = make_norm(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(x)))


class Pooler(nn.Module):
    """BERT pooler: tanh(dense(x[:, 0])), (B, T, d) -> (B, d)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


def split_fused_projections(
    model: Transformer, state_dict: dict[str, Tensor], prefix: str, *_hook_args: object
) -> None:
    """``load_state_dict`` pre-hook: a state dict written before q, k, v and a GLU's gate / fc were separate
    projections (fused ``attn.qkv`` = [q; k; v], ``cross_attn.kv`` = [k; v], GLU ``mlp.fc`` = [gate; fc]) has its
    fused weights split into today's names, in place; any other state dict is left as it is."""
    cfg, sizes = model.config, model.config.sizes
    q_rows, kv_rows = cfg.n_head * sizes.head_dim, sizes.n_kv_head * sizes.head_dim
    for key in [k for k in state_dict if k.startswith(prefix)]:
        module, _, leaf = key.rpartition(".")
        owner, _, name = module.rpartition(".")
        if name == "qkv":
            parts = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        elif name == "kv":
            parts = {"k": kv_rows, "v": kv_rows}
        elif name == "fc" and cfg.gated and state_dict[key].shape[0] == 2 * sizes.d_ff:
            parts = {"gate": sizes.d_ff, "fc": sizes.d_ff}
        else:
            continue
        pieces = state_dict.pop(key).split(list(parts.values()))
        state_dict.update(
            {f"{owner}.{part}.{leaf}": piece for part, piece in zip(parts, pieces, strict=True)}
        )


class Transformer(nn.Module):
    """Decoder-only, encoder-only or encoder-decoder transformer described by a :class:`ModelConfig`.

    Set ``gradient_checkpointing = True`` to recompute blocks in the backward pass, and ``check_inputs = False``
    to skip the data-dependent token-id range check (one device sync per forward).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config = dataclasses.replace(config)  # its own copy: set_attention never changes the caller's config
        self.config = config
        self.embed = Embeddings(config)
        enc_dec = config.arch == "encoder-decoder"
        self.encoder = Stack(config, config.n_layer, False, False) if config.arch != "decoder" else None
        n_dec = config.sizes.n_decoder_layer if enc_dec else config.n_layer
        self.decoder = Stack(config, n_dec, True, enc_dec) if config.arch != "encoder" else None
        self.pooler = Pooler(config) if config.pooler else None
        self.mlm_transform = MLMTransform(config) if config.mlm_head_transform else None
        self.lm_head = (
            nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias) if config.lm_head else None
        )
        self.init_weights()
        self.tie_weights()
        self.gradient_checkpointing = False
        self.check_inputs = True
        self.register_load_state_dict_pre_hook(split_fused_projections)

    @torch.no_grad()
    def init_weights(self) -> None:
        """gpt2: every weight N(0, init_std), residual output projections N(0, init_std / sqrt(2 n_layer))
        (Radford et al. 2019); bert: every weight N(0, init_std); t5 (HF T5PreTrainedModel): linear weights
        N(0, fan_in^-1/2) with query rows further scaled by d_h^-1/2 (T5 does not scale attention logits),
        embeddings and an untied LM head N(0, 1), relative bias N(0, d^-1/2). Biases 0, norms 1.
        muP (gpt2 / bert): hidden linear weights (all but the LM head) std / sqrt(m), m = config.width_mult; t5's
        fan-in init already scales so. ``zero_init_projections``: attention output and MLP down projections 0."""
        cfg = self.config
        t5 = cfg.init == "t5"
        hidden_std = cfg.init_std / math.sqrt(cfg.width_mult)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = cfg.init_std if module is self.lm_head else hidden_std
                nn.init.normal_(module.weight, std=module.in_features**-0.5 if t5 else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0 if t5 else cfg.init_std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        for module in self.modules():
            if t5 and isinstance(module, Attention):
                module.q.weight.mul_(module.head_dim**-0.5)
            elif t5 and isinstance(module, RelativePositionBias):
                nn.init.normal_(module.embedding.weight, std=cfg.d_model**-0.5)
            elif cfg.init == "gpt2" and isinstance(module, (Attention, MLP)):
                out = module.out if isinstance(module, Attention) else module.proj
                nn.init.normal_(out.weight, std=hidden_std / math.sqrt(2 * cfg.n_layer))
            if cfg.zero_init_projections and isinstance(module, (Attention, MLP)):
                nn.init.zeros_((module.out if isinstance(module, Attention) else module.proj).weight)
        if t5 and self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=1.0)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        prefix_lengths: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        target_positions: Tensor | None = None,
        prefix_mask: Tensor | None = None,
        decoder_position_ids: Tensor | None = None,
        decoder_document_ids: Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T) 1 = real, 0 = padding; token_type_ids, position_ids,
        document_ids (B, T) (block-diagonal attention within equal ids); prefix_lengths (B,) (decoder: the first
        prefix_lengths[b] tokens attend bidirectionally). Encoder-decoder: input_ids feed the encoder,
        decoder_input_ids (B, T_dec) the decoder. With ``cache`` only the new tokens are passed.

        Packed documents (``pretrain.objectives``; ``docs/data.md``): document_ids with position_ids restarting
        at each document; prefix_mask (B, T) 1 = the token is in its document's bidirectional prefix (decoder
        prefix LM, one split per document); decoder_document_ids / decoder_position_ids (B, T_dec) for the
        encoder-decoder's decoder, whose cross-attention then reads its own document's encoder positions
        (document_ids; decoder document id -1 = padding).

        target_positions (N,): indices into the flattened (B * T) output positions (decoder side for
        encoder-decoder); the LM head (and BERT's transform) then runs on those N positions only and ``logits``
        is (N, V) -- the rows of the all-positions logits ``logits.flatten(0, 1)[target_positions]``, at
        N / (B T) of the head's cost (MLM predicts ~15 % of positions)."""
        cfg = self.config
        if cfg.arch != "decoder" and (prefix_lengths is not None or prefix_mask is not None):
            raise ValueError("prefix_lengths / prefix_mask are only supported for arch='decoder' (prefix-LM)")
        if decoder_document_ids is not None and (cfg.arch != "encoder-decoder" or document_ids is None):
            raise ValueError(
                "decoder_document_ids needs arch='encoder-decoder' and the encoder's document_ids (cross-attention "
                "reads the decoder's own document)"
            )
        if cache is None and use_cache:
            if self.decoder is None:
                raise ValueError("use_cache=True needs a decoder (arch 'decoder' or 'encoder-decoder')")
            cache = KVCache(len(self.decoder.blocks))
        encoder_hidden = None
        if self.decoder is None:  # arch encoder
            hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids, document_ids)
        elif self.encoder is None:  # arch decoder
            hidden = self._run(
                self.decoder,
                input_ids,
                attention_mask,
                token_type_ids,
                position_ids,
                document_ids,
                prefix_lengths,
                cache=cache,
                prefix_keys=None if prefix_mask is None else prefix_mask.bool(),
            )
        else:
            if decoder_input_ids is None:
                raise ValueError(
                    "decoder_input_ids (B, T_dec) is required for arch='encoder-decoder' "
                    "(targets shifted right, starting with decoder_start_token_id)"
                )
            memory_mask = attention_mask
            if cache is not None and cache.has_encoder:  # encoder output already projected into the cache
                memory_mask = cache.encoder_mask
            else:
                encoder_hidden = self.encode(
                    input_ids, attention_mask, token_type_ids, position_ids, document_ids
                )
                if cache is not None:
                    cache.encoder_mask = attention_mask
            hidden = self._run(
                self.decoder,
                decoder_input_ids,
                decoder_attention_mask,
                None,
                decoder_position_ids,
                decoder_document_ids,
                None,
                memory=encoder_hidden,
                memory_mask=memory_mask,
                cache=cache,
                memory_document_ids=document_ids if decoder_document_ids is not None else None,
            )
        head_input = hidden if target_positions is None else hidden.flatten(0, 1)[target_positions]
        return ModelOutput(
            logits=self.logits(head_input) if self.lm_head is not None else None,
            hidden_states=hidden,
            encoder_hidden_states=encoder_hidden,
            pooled_output=self.pooler(hidden) if self.pooler is not None else None,
            cache=cache if use_cache else None,
        )

    def encode(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Encoder stack only: input_ids (B, S) -> hidden states (B, S, d)."""
        if self.encoder is None:
            raise ValueError("encode() needs an encoder: config.arch must be 'encoder' or 'encoder-decoder'")
        return self._run(
            self.encoder, input_ids, attention_mask, token_type_ids, position_ids, document_ids, None
        )

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states (..., d) -> logits (..., V); muP multiplies the LM head's input by 1 / m."""
        if self.config.logit_scale != 1.0:
            hidden = hidden * self.config.logit_scale
        if self.mlm_transform is not None:
            hidden = self.mlm_transform(hidden)
        if self.config.width_mult != 1.0:
            hidden = hidden / self.config.width_mult
        if self.lm_head is None:
            raise ValueError("logits() needs an LM head: config.lm_head is False (backbone only)")
        return self.lm_head(hidden)

    def _run(
        self,
        stack: Stack,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        document_ids: Tensor | None,
        prefix_lengths: Tensor | None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
        prefix_keys: Tensor | None = None,
        memory_document_ids: Tensor | None = None,
    ) -> Tensor:
        """Validate, embed, run one stack: (B, T) ids -> (B, T, d)."""
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("input_ids must be a (B, T) tensor of token ids")
        past = cache.seq_len if cache is not None else 0
        if document_ids is not None and past:
            raise ValueError("document_ids cannot be combined with a non-empty cache")
        self._check_inputs(input_ids, past, position_ids)
        if (
            position_ids is None and stack.context_parallel is not None
        ):  # this rank's positions of the sequence
            position_ids = stack.context_parallel.positions(input_ids.shape[1], input_ids.device)[None]
        elif position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(input_ids, position_ids, token_type_ids)
        global_ids = None
        if self.config.attention_global_token_ids and not stack.causal:  # e.g. [CLS] / [SEP] (Longformer)
            global_ids = torch.isin(input_ids, input_ids.new_tensor(self.config.attention_global_token_ids))
        return stack(
            x,
            position_ids,
            attention_mask,
            document_ids,
            prefix_lengths,
            memory,
            memory_mask,
            cache,
            checkpointing=self.gradient_checkpointing and self.training,
            global_ids=global_ids,
            prefix_keys=prefix_keys,
            memory_document_ids=memory_document_ids,
        )

    def _check_inputs(self, input_ids: Tensor, past: int, position_ids: Tensor | None) -> None:
        cfg = self.config
        absolute = cfg.position in ("learned", "sinusoidal")
        if absolute and past + input_ids.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {past + input_ids.shape[1]} (input_ids + cache) exceeds max_seq_len="
                f"{cfg.max_seq_len} of the {cfg.position} position embeddings; shorten input_ids"
            )
        if not self.check_inputs or input_ids.is_meta or torch.compiler.is_compiling():
            return
        low, high = torch.aminmax(input_ids)
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(
                f"input_ids contain token id {int(high if high >= cfg.vocab_size else low)} outside "
                f"[0, vocab_size={cfg.vocab_size}); check the tokenizer matches the model"
            )
        if absolute and position_ids is not None and int(position_ids.max()) >= cfg.max_seq_len:
            raise ValueError(f"position_ids reach {int(position_ids.max())} >= max_seq_len={cfg.max_seq_len}")

    def tie_weights(self) -> None:
        """The LM head shares the token embedding's table (``tie_embeddings``), also after a strategy replaced
        the table's parameter (``pretrain.parallel.tensor``)."""
        if self.lm_head is not None and self.config.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (torchtitan's per-block ``fully_shard``): every transformer block."""
        return [
            block for stack in (self.encoder, self.decoder) if stack is not None for block in stack.blocks
        ]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, Any]:
        """Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) as torch's DTensor styles by module name, for
        ``parallelize_module`` (``pretrain.parallel.tensor`` applies it). q, k, v and the MLP's gate and fc are
        split column-wise (a rank computes whole heads and a slice of the MLP width), out and proj row-wise (their
        partial sums all-reduced); the token embedding and the LM head split the vocabulary, whose logits stay
        sharded for the vocabulary-parallel cross entropy (``loss_parallel``); T5's relative bias splits its
        heads. A branch's input is made a replicated DTensor once, so its projections' input gradients are summed
        before one reduction.

        ``sequence_parallel`` (Korthikanti et al. 2022): between the branches the activations are split along
        the sequence; the norms run on their slice (``SequenceParallel``), a branch all-gathers its input and
        reduce-scatters its output, the embedding output is split and each stack's output gathered again.
        Every other parameter (position and segment embeddings, norms without sequence parallelism, QK-norm
        gains, BERT's head transform, the pooler) is replicated (``Replicated``), so all live on the tp mesh."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        from pretrain.parallel.tensor import Replicated

        between = Shard(1) if sequence_parallel else Replicate()  # blocks' activations between branches

        def branch_input(positional: int, **kwargs: Any) -> PrepareModuleInput:
            layouts = (between,) + (None,) * (positional - 1)
            return PrepareModuleInput(
                input_layouts=layouts,
                desired_input_layouts=(Replicate(),) + layouts[1:],
                input_kwarg_layouts=kwargs or None,
                desired_input_kwarg_layouts=kwargs or None,
            )

        plan: dict[str, Any] = {"embed.tok": RowwiseParallel(input_layouts=Replicate())}
        for name in ("pos", "segment", "norm"):
            if getattr(self.embed, name) is not None:
                plan[f"embed.{name}"] = Replicated()
        for name in ("mlm_transform", "pooler"):
            if getattr(self, name) is not None:
                plan[name] = Replicated()
        if sequence_parallel:
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        for name, stack in (("encoder", self.encoder), ("decoder", self.decoder)):
            if stack is None:
                continue
            blocks = f"{name}.blocks.*"
            plan[f"{blocks}.attn"] = branch_input(3)  # (x, mask, rope)
            plan[f"{blocks}.mlp"] = branch_input(1)
            attentions = ["attn"]
            if stack.blocks[0].cross_attn is not None:  # (x, mask), memory: the encoder output, replicated
                plan[f"{blocks}.cross_attn"] = branch_input(2, memory=Replicate())
                attentions.append("cross_attn")
            linears = [f"{a}.{p}" for a in attentions for p in "qkv"] + ["mlp.fc"]
            linears += ["mlp.gate"] if self.config.gated else []
            plan.update({f"{blocks}.{linear}": ColwiseParallel() for linear in linears})
            rows = RowwiseParallel(output_layouts=between)
            plan.update({f"{blocks}.{out}": rows for out in [f"{a}.out" for a in attentions] + ["mlp.proj"]})
            if stack.relative_bias is not None:  # the (buckets, h) table: a rank's heads
                plan[f"{name}.relative_bias.embedding"] = ColwiseParallel()
            if self.config.qk_norm:  # on a rank's heads
                norms = [f"{a}.{n}" for a in attentions for n in ("q_norm", "k_norm")]
                plan.update({f"{blocks}.{n}": Replicated(Shard(1)) for n in norms})
            norms = [
                f"{blocks}.{n}" for n in ["norm1", "norm2"] + ["norm_cross"] * ("cross_attn" in attentions)
            ]
            norms += [f"{name}.norm"] if stack.norm is not None else []
            if sequence_parallel:
                plan.update({n: SequenceParallel(use_local_output=True) for n in norms})
                plan[name] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
            else:
                plan.update({n: Replicated() for n in norms})
        if self.lm_head is not None:
            plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return plan

    def tp_sharded_randomness(self, sequence_parallel: bool = False) -> list[nn.Module]:
        """The modules of :meth:`tp_plan` whose random draws (dropout) fall on activations the tensor-parallel
        ranks split -- a rank's heads (attention dropout), with ``sequence_parallel`` a slice of the sequence (the
        blocks' residual dropout) -- so each rank must draw its own; every other draw falls on replicated
        activations and must be the same on all of them."""
        blocks = [m for m in self.modules() if isinstance(m, Block)]  # encoder's, then decoder's
        modules: list[nn.Module] = []
        if self.config.attn_dropout:
            modules += [m for block in blocks for m in (block.attn, block.cross_attn) if m is not None]
        if sequence_parallel and self.config.dropout:
            modules += [block.drop for block in blocks]
        return modules

    def set_attention(self, backend: str) -> Transformer:
        """Compute attention with ``backend`` ('sdpa' | 'flex') from now on; same weights, same function."""
        dataclasses.replace(self.config, attention=backend)  # validates: ValueError naming the field
        self.config.attention = backend  # the model's own copy, shared by its stacks, read at every forward
        return self

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of (unique) parameters; ``exclude_embeddings`` drops the token, position and segment tables
        (a tied LM head shares the token table and is dropped with it)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            tables = (self.embed.tok, self.embed.pos, self.embed.segment)
            n -= sum(t.weight.numel() for t in tables if t is not None)
        return n

    def flops_per_token(
        self, seq_len: int, decoder_seq_len: int | None = None, head_positions: float | None = None
    ) -> float:
        """Training (forward + backward) matmul FLOPs per input token, i.e. the 6N + 12 L h d_h T rule
        (Kaplan et al. 2020) made exact for this model:

            F(sample) = 6 * sum_W numel(W) * tokens(W) + 12 * h * d_h * sum_attention T_query * T_key
            flops_per_token = F(sample) / seq_len

        where W runs over every linear weight (attention, MLP, MLM transform, LM head, tied or not, pooler) and
        tokens(W) is how many positions it is applied to: seq_len (= S) for the encoder / decoder-only stack,
        decoder_seq_len (= T, default S) for the encoder-decoder decoder and its LM head, S for cross-attention
        k, v projections, 1 for the pooler, head_positions (default T; fewer with ``target_positions``) for the
        MLM transform and LM head. Attention terms: S*S per encoder layer, T*T (self) + T*S (cross) per decoder
        layer (decoder-only: S*S). Causal masking is not discounted (SDPA computes full tiles), and
        embeddings, norms, biases and softmax are not counted. Forward = 1/3 of it.
        """
        cfg = self.config

        def linear(module: nn.Module | None) -> int:
            if module is None:
                return 0
            return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

        S = seq_len
        T = (decoder_seq_len or seq_len) if cfg.arch == "encoder-decoder" else seq_len
        per_attention = 12 * cfg.n_head * cfg.sizes.head_dim
        flops: float = 6 * linear(self.pooler)
        if self.encoder is not None:
            flops += 6 * linear(self.encoder) * S + per_attention * len(self.encoder.blocks) * S * S
        if self.decoder is not None:
            cross_kv = sum(
                linear(a.k) + linear(a.v)
                for a in self.decoder.modules()
                if isinstance(a, Attention) and a.cross
            )
            cross = T * S if cfg.arch == "encoder-decoder" else 0
            flops += 6 * (linear(self.decoder) - cross_kv) * T + 6 * cross_kv * S
            flops += per_attention * len(self.decoder.blocks) * (T * T + cross)
        flops += (
            6
            * (linear(self.mlm_transform) + linear(self.lm_head))
            * (T if head_positions is None else head_positions)
        )
        return flops / seq_len
