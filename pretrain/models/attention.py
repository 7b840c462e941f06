"""Attention masks and kernels: one mask definition, two backends.

Axes: B batch, h heads, T queries, S keys, d_h head width. Every mask is a ``mask_mod(b, h, q, k) -> bool``
(True = query q may attend key k; q counts from the current call, its absolute position is past_len + q). The
sdpa backend evaluates it on broadcast index grids into a dense (B|1, 1, T, S) mask for
``F.scaled_dot_product_attention``; the flex backend turns it into a ``BlockMask`` for
``torch.nn.attention.flex_attention``, which skips fully masked (block_size x block_size) tiles, and adds T5's
relative bias through a ``score_mod`` instead of a dense (B|1, h, T, S) tensor.

Self-attention (query at absolute position p = past_len + q, key at k):

    sparse(p, k) = |p - k| < window (encoder) or 0 <= p - k < window (decoder)          [all keys if window = 0]
                   or min(p, k) < global_tokens or global_id[p] or global_id[k]          (Longformer / BigBird)
                   or random[p // block, k // block]                                      (BigBird random blocks)
    allowed(p, k) = sparse & (k <= p or k < prefix_length or prefix[k])  [causal only]
                    & doc[p] == doc[k] & key is real
                    or k == p                                (no row is fully masked)

Packed documents: ``doc`` (B, S) holds each token's document id, indexed by absolute position for query and key
alike, so the same mask_mod serves a shard of the queries at any offset (context parallelism: past_len = the
shard's first position). ``prefix`` (B, S) marks the tokens of each document's bidirectional prefix (prefix LM
over packed documents). Cross-attention (decoder query q, encoder key k): ``doc_dec[q] == doc_enc[k]`` & key is
real; a padding query (document id < 0) reads key 0 only, so no row is fully masked (its output is unused).

The random table draws r key blocks per query block from ``torch.Generator().manual_seed(seed)`` (decoders draw
among past blocks only), so a pattern is a pure function of the config and the length: a checkpoint evaluates
identically. One pattern is shared by all heads and layers (BigBird draws one per head and layer).

Context parallelism (``pretrain.parallel.context``): a rank holds the queries at ``query_positions`` (T,) of the
whole sequence, which stand for p in place of past_len + q, and the keys of every rank (``AttentionMask.gather``
all-gathers them before the kernel); the per-token tensors read at p (document ids, global ids) then span the keys.
A plain causal mask (no padding, documents, prefixes, sparse pattern, bias or attention dropout) needs no mask
there: each of the rank's query chunks (``query_chunks``: C queries from position s) attends the keys before it
with no mask and its own diagonal (C x C) block with ``is_causal``, two calls of CPU SDPA's flash kernel merged by
their log-sum-exp (:class:`ChunkCausal`), so no (T/N x S) mask is made or kept for the backward. Any other
self-attention mask (packed documents, prefix LM, sliding window, sparse patterns, key padding, bidirectional)
goes block by block (:class:`BlockMasked`): each block of a few hundred queries against the key range it can
reach, with its slice of the mask made from the ``mask_mod`` for that call (and again in the backward), never
the whole (T/N x S). T5's relative bias and attention dropout keep the dense mask.

flex_attention has no backward on CPU (torch 2.13 raises NotImplementedError) and no dropout, and a compiled
kernel recompiles for every new key length; so the flex backend computes through SDPA, on the dense mask of the
same ``mask_mod``, for CPU training steps, for training with attention dropout and for KV-cache steps
(past_len > 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretrain.compat.attention import cpu_flash, cpu_flash_backward
from pretrain.models.config import ModelConfig

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# BlockMasked: a block has as many queries as make BLOCK_ELEMENTS elements of its mask (B x queries x keys), and
# at least MIN_BLOCK_QUERIES
BLOCK_ELEMENTS, MIN_BLOCK_QUERIES = 2**20, 16
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SparsePattern:
    """Sliding window, global tokens and random blocks of one stack (see the module docstring)."""

    causal: bool
    window: int = 0
    global_tokens: int = 0
    random_blocks: int = 0
    block_size: int = 128
    seed: int = 0
    min_blocks: int = 1  # random tables are drawn for at least this many blocks (max_seq_len), then sliced

    @classmethod
    def from_config(cls, config: ModelConfig, causal: bool) -> SparsePattern:
        return cls(
            causal,
            config.attention_window,
            config.attention_global_tokens,
            config.attention_random_blocks,
            config.attention_block_size,
            config.attention_seed,
            -(-config.max_seq_len // config.attention_block_size),
        )

    @property
    def active(self) -> bool:
        return bool(self.window or self.global_tokens or self.random_blocks)


@functools.lru_cache(maxsize=16)
def random_block_table(n_blocks: int, r: int, seed: int, causal: bool) -> Tensor:
    """(n_blocks, n_blocks) bool: row i holds r distinct key blocks drawn for query block i (among blocks <= i
    when causal; rows with fewer candidates take them all)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.zeros(n_blocks, n_blocks, dtype=torch.bool, device="cpu")
    for i in range(n_blocks):
        candidates = i + 1 if causal else n_blocks
        table[i, torch.randperm(candidates, generator=generator, device="cpu")[:r]] = True
    return table


@dataclass
class MaskInputs:
    """Everything a self- or cross-attention mask is built from. Tensors: key_mask (B, S) True = real key,
    document_ids (B, S) by absolute position (cross-attention: the queries' (B, T)), key_document_ids (B, S) the
    encoder's (cross-attention), prefix_lengths (B,), prefix_keys (B, S) True = in its document's prefix,
    global_ids (B, T) True = global token; random_table: the pattern's
    ``random_block_table`` for ``min_blocks`` blocks, already on the device (a stack buffer, so a compiled
    forward draws nothing: a generator inside the graph is a graph break); drawn here if the keys need more."""

    query_len: int
    key_len: int
    past_len: int = 0
    causal: bool = False
    cross: bool = False
    key_mask: Tensor | None = None
    document_ids: Tensor | None = None
    prefix_lengths: Tensor | None = None
    global_ids: Tensor | None = None
    pattern: SparsePattern | None = None
    random_table: Tensor | None = None
    prefix_keys: Tensor | None = None
    key_document_ids: Tensor | None = None
    query_positions: Tensor | None = None  # (T,) absolute position of each query (context parallelism)
    # context parallelism: the first position of each of the equal, contiguous runs the queries are made of
    query_chunks: tuple[int, ...] | None = None

    def _batched(self) -> tuple[Tensor | None, ...]:
        return (
            self.key_mask,
            self.document_ids,
            self.prefix_lengths,
            self.global_ids,
            self.prefix_keys,
            self.key_document_ids,
        )

    @property
    def batch_free(self) -> bool:
        """True when the mask is the same for every sample (so it can be cached across steps)."""
        return all(t is None for t in self._batched())

    @property
    def batch(self) -> int:
        for t in self._batched():
            if t is not None:
                return t.shape[0]
        return 1

    def mask_mod(self, device: torch.device) -> MaskMod:
        """The ``mask_mod`` of the module docstring; works on scalars (flex) and broadcast index grids (sdpa)."""
        key_mask = None if self.key_mask is None else self.key_mask.to(device=device, dtype=torch.bool)
        if self.cross:
            return self._cross_mask_mod(key_mask)
        past, pattern = self.past_len, self.pattern
        docs, prefix, global_ids = self.document_ids, self.prefix_lengths, self.global_ids
        prefix_keys = self.prefix_keys
        table = None
        if pattern is not None and pattern.random_blocks:
            n_blocks = max(pattern.min_blocks, -(-self.key_len // pattern.block_size))
            table = self.random_table
            if table is None or table.shape[0] != n_blocks:
                table = random_block_table(n_blocks, pattern.random_blocks, pattern.seed, pattern.causal)
            table = table.to(device)

        positions = self.query_positions
        if positions is not None:
            positions = positions.to(device)

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            p = q + past if positions is None else positions[q]
            sparse = []  # alternatives a sparse pattern allows
            if pattern is not None and pattern.window:
                sparse.append(
                    (p - k < pattern.window) if pattern.causal else ((p - k).abs() < pattern.window)
                )
            if pattern is not None and pattern.global_tokens:
                sparse.append((k < pattern.global_tokens) | (p < pattern.global_tokens))
            if table is not None and pattern is not None:  # a table comes from a pattern
                sparse.append(table[p // pattern.block_size, k // pattern.block_size])
            if global_ids is not None:
                sparse.append(global_ids[b, p] | global_ids[b, k])
            ok = functools.reduce(torch.logical_or, sparse) if sparse else k >= 0
            if self.causal:
                past_or_prefix = k <= p
                if prefix is not None:
                    past_or_prefix = past_or_prefix | (k < prefix[b])
                if prefix_keys is not None:
                    past_or_prefix = past_or_prefix | prefix_keys[b, k]
                ok = ok & past_or_prefix
            if docs is not None:
                ok = ok & (docs[b, p] == docs[b, k])
            if key_mask is not None:
                ok = ok & key_mask[b, k]
            return ok | (k == p)

        return mask_mod

    def _cross_mask_mod(self, key_mask: Tensor | None) -> MaskMod:
        """Cross-attention: real keys of the query's own document (module docstring)."""
        query_docs, key_docs = self.document_ids, self.key_document_ids

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            ok = key_mask[b, k] if key_mask is not None else k >= 0
            # Transformer.forward gives the cross-attention MaskInputs both document ids or neither
            if query_docs is None or key_docs is None:
                return ok
            return (ok & (query_docs[b, q] == key_docs[b, k])) | ((query_docs[b, q] < 0) & (k == 0))

        return mask_mod

    def needs_mask(self) -> bool:
        """False when SDPA needs no explicit mask (full attention, or plain causal from position 0)."""
        plain = self.batch_free and (self.pattern is None or not self.pattern.active)
        plain = plain and self.query_positions is None
        return not (plain and (not self.causal or self.query_len == 1 or self.past_len == 0))

    def chunk_causal(self) -> bool:
        """True when the queries are context-parallel chunks under a plain causal mask (nothing but ``k <= p``):
        attention needs no mask (:class:`ChunkCausal`)."""
        plain = self.batch_free and (self.pattern is None or not self.pattern.active)
        return (
            plain and self.causal and not self.cross and not self.past_len and self.query_chunks is not None
        )

    def query_blocks(self) -> list[tuple[int, int, int, int]]:
        """Context parallelism (``query_chunks`` set): (first, end) local queries and (first, end) keys of each
        block :class:`BlockMasked` computes. Each query chunk is cut into blocks of ``BLOCK_ELEMENTS`` / (B S)
        queries (``MIN_BLOCK_QUERIES`` at least); a block reads keys up to its last position when causal (no
        prefix), and within its positions' window under a sliding window that is the only sparse alternative."""
        assert self.query_chunks is not None
        size = self.query_len // len(self.query_chunks)
        step = max(MIN_BLOCK_QUERIES, BLOCK_ELEMENTS // (self.batch * self.key_len))
        pattern = self.pattern
        window = 0
        if pattern is not None and not (pattern.global_tokens or pattern.random_blocks):
            window = 0 if self.global_ids is not None else pattern.window
        causal_end = self.causal and self.prefix_lengths is None and self.prefix_keys is None
        blocks = []
        for i, start in enumerate(self.query_chunks):
            for offset in range(0, size, step):
                n = min(step, size - offset)
                first, last = start + offset, start + offset + n - 1  # global positions
                lo = max(0, first - window + 1) if window else 0
                if causal_end:
                    hi = last + 1
                else:  # a causal window (p - k < w) passes every later key of a prefix
                    hi = min(self.key_len, last + window) if window and not self.causal else self.key_len
                blocks.append((i * size + offset, i * size + offset + n, lo, hi))
        return blocks

    def allowed(self, device: torch.device, queries: Tensor, keys: Tensor) -> Tensor:
        """(B|1, 1, len(queries), len(keys)) bool: the mask_mod at these query indices (of this call) and keys."""
        b = torch.arange(self.batch, device=device)[:, None, None, None]
        zero = torch.zeros((), dtype=torch.long, device=device)
        allowed = self.mask_mod(device)(b, zero, queries[:, None], keys[None, :])
        shape = (len(queries), len(keys))
        return allowed.expand(-1, 1, *shape) if allowed.dim() == 4 else allowed[None, None]

    def dense(self, device: torch.device) -> Tensor:
        """(B|1, 1, T, S) bool mask, the mask_mod evaluated on broadcast index grids."""
        arange = functools.partial(torch.arange, device=device)
        return self.allowed(device, arange(self.query_len), arange(self.key_len))


@functools.cache
def _compiled_flex() -> Callable:
    """flex_attention compiled on first use (compiling imports the inductor: ~1 CPU-s a process need not pay)."""
    return torch.compile(flex_attention, dynamic=False)


class AttentionMask:
    """One stack's mask (shared by its layers) in the form its backend needs, built once per forward.

    ``x``: the stack input (B, T, d); its device and whether it needs gradients pick flex or SDPA, as does
    ``dropout`` (attention dropout is active: flex has none). ``bias``: T5
    relative bias as ``(dense () -> (B|1, h, T, S), score_mod)``; SDPA gets the dense bias with the mask folded
    in (masked logits = finfo.min), flex_attention the score_mod. ``cache``: a dict kept by the stack; block masks
    that depend only on shapes (no padding, documents, prefixes, global ids) are reused across steps. ``gather``:
    keys or values (B, g, S_local, d_h) -> (B, g, S, d_h) of the whole sequence (context parallelism).
    """

    def __init__(
        self,
        inputs: MaskInputs,
        backend: str,
        x: Tensor,
        bias: tuple[Callable[[], Tensor], ScoreMod] | None = None,
        cache: dict | None = None,
        dropout: bool = False,
        gather: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.gather = gather
        grad = torch.is_grad_enabled() and x.requires_grad
        cpu_grad = grad and x.device.type in ("cpu", "mps")
        self.flex = backend == "flex" and not inputs.past_len and not cpu_grad and not dropout
        self.score_mod = bias[1] if bias is not None and self.flex else None
        self.block_mask = self._block_mask(inputs, x.device, cache) if self.flex else None
        self.dense, self.is_causal = None, False
        # context parallelism's self-attention on the CPU: mask-free chunks under a plain causal mask
        # (ChunkCausal), else block by block with each block's slice of the mask (BlockMasked)
        split = (
            not self.flex
            and bias is None
            and not dropout
            and x.device.type == "cpu"
            and inputs.query_chunks is not None
            and not inputs.cross
            and not inputs.past_len
        )
        self.chunks = inputs.query_chunks if split and inputs.chunk_causal() else None
        self.blocks = inputs.query_blocks() if split and self.chunks is None else None
        self.inputs = inputs
        if self.flex or split:
            return
        if bias is not None:
            dense = bias[0]()
            if inputs.needs_mask() or inputs.causal:
                dense = dense.masked_fill(~inputs.dense(x.device), torch.finfo(dense.dtype).min)
            self.dense = dense.to(x.dtype)
        elif inputs.needs_mask():
            self.dense = inputs.dense(x.device)
        else:  # SDPA's is_causal fast path (FlashAttention on GPU)
            self.is_causal = inputs.causal and inputs.query_len > 1

    @staticmethod
    def _block_mask(inputs: MaskInputs, device: torch.device, cache: dict | None) -> BlockMask | None:
        """flex_attention's BlockMask (None = every key visible)."""
        if not inputs.needs_mask() and not inputs.causal:
            return None
        i = inputs
        if torch.compiler.is_compiling():
            cache = (
                None  # built inside the graph: a cache lookup would be a guard on the dict, i.e. a recompile
            )
        key = (i.query_len, i.key_len, i.causal, i.cross, i.pattern, str(device))
        if i.batch_free and cache is not None and key in cache:
            return cache[key]
        block_mask = create_block_mask(
            i.mask_mod(device),
            B=None if i.batch_free else i.batch,
            H=None,
            Q_LEN=i.query_len,
            KV_LEN=i.key_len,
            device=device,
            BLOCK_SIZE=i.pattern.block_size if i.pattern is not None else 128,
        )
        if i.batch_free and cache is not None:
            if len(cache) >= 16:  # a few shapes are live at a time (train, eval, prefill)
                cache.clear()
            cache[key] = block_mask
        return block_mask


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, scale: float | None, dropout: float
) -> Tensor:
    """q (B, h, T, d_h), k and v (B, g, S, d_h) with g dividing h -> (B, h, T, d_h); ``scale`` None means
    1/sqrt(d_h)."""
    if mask is not None and mask.gather is not None:
        k, v = mask.gather(k), mask.gather(v)
    gqa = k.shape[1] != q.shape[1]
    if mask is not None and (mask.chunks is not None or mask.blocks is not None):
        if gqa:  # the flash kernel's own call takes as many key/value heads as query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        if mask.blocks is not None:
            return BlockMasked.apply(q, k, v, mask.blocks, mask.inputs, scale)
        chunks = mask.chunks
        assert chunks is not None  # the condition above, with blocks None
        size = q.shape[2] // len(chunks)
        return torch.cat(
            [ChunkCausal.apply(q[:, :, i * size : (i + 1) * size], k, v, start, scale)
             for i, start in enumerate(chunks)],
            dim=2,
        )  # fmt: skip
    if mask is not None and mask.flex:
        # torch's stubs give flex_attention the bare type `function`, which mypy does not call
        kernel = (
            cast(Callable[..., Any], flex_attention) if torch.compiler.is_compiling() else _compiled_flex()
        )
        return kernel(q, k, v, mask.score_mod, mask.block_mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if mask is None else mask.dense,
        dropout_p=dropout,
        is_causal=mask is not None and mask.is_causal,
        scale=scale,
        enable_gqa=gqa,
    )


class ChunkCausal(torch.autograd.Function):
    """Causal attention of C queries at positions start..start+C-1 against keys 0..start+C-1 of ``k``, ``v``
    (B, h, S, d_h), without a mask: the keys before ``start`` are all visible (one call, no mask), the diagonal
    (C x C) block is causal from its corner (one call, ``is_causal``); CPU SDPA's flash kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) returns each call's log-sum-exp, by which the two are merged
    (in float32). The backward is the kernel's own for each block, given the merged output and log-sum-exp (as
    ring attention's): the query gradients summed, the key and value gradients of each block in place. Exact
    softmax attention: equal to one process's causal SDPA up to float rounding."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, start: int, scale: float | None) -> Tensor:
        size = q.shape[2]
        blocks = [
            (lo, hi, causal) for lo, hi, causal in ((0, start, False), (start, start + size, True)) if hi > lo
        ]
        parts = [cpu_flash(q, k[:, :, lo:hi], v[:, :, lo:hi], causal, scale) for lo, hi, causal in blocks]
        out, lse = parts[0]
        if len(parts) == 2:
            (o1, l1), (o2, l2) = parts
            lse = torch.logaddexp(l1, l2)
            merged = o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)
            out = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = None, torch.zeros_like(k), torch.zeros_like(v)
        for lo, hi, causal in ctx.blocks:
            gq, gk, gv = cpu_flash_backward(
                grad, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, causal, ctx.scale
            )
            dq = gq if dq is None else dq + gq
            dk[:, :, lo:hi], dv[:, :, lo:hi] = gk, gv
        return dq, dk, dv, None, None


class BlockMasked(torch.autograd.Function):
    """Attention of a context-parallel rank's queries under any self-attention mask, block by block
    (:meth:`MaskInputs.query_blocks`): each block of queries against the key range it can reach, one call of CPU
    SDPA's flash kernel with that block's slice of the mask, additive in the queries' dtype, made from the
    ``mask_mod`` for the call and dropped after it. The backward makes each block's slice again and runs the
    kernel's backward per block (the query gradients of a block are its own; key and value gradients summed over
    blocks). Kept for the backward: q, k, v, the output and the log-sum-exp, no (T/N x S) mask."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        blocks: list[tuple[int, int, int, int]],
        inputs: MaskInputs,
        scale: float | None,
    ) -> Tensor:
        outs, lses = [], []
        for a, b, lo, hi in blocks:
            mask = BlockMasked.mask(inputs, q, a, b, lo, hi)
            out, lse = cpu_flash(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], False, scale, mask)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.inputs, ctx.scale = blocks, inputs, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, lo, hi in ctx.blocks:
            mask = BlockMasked.mask(ctx.inputs, q, a, b, lo, hi)
            gq, gk, gv = cpu_flash_backward(
                grad[:, :, a:b].contiguous(),
                q[:, :, a:b],
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                out[:, :, a:b].contiguous(),
                lse[:, :, a:b].contiguous(),
                False,
                ctx.scale,
                mask,
            )
            dq[:, :, a:b] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk, dv, None, None, None

    @staticmethod
    def mask(inputs: MaskInputs, q: Tensor, a: int, b: int, lo: int, hi: int) -> Tensor:
        """(B|1, 1, b - a, hi - lo) additive mask of queries a..b-1 (of this call) against keys lo..hi-1."""
        device = q.device
        allowed = inputs.allowed(
            device, torch.arange(a, b, device=device), torch.arange(lo, hi, device=device)
        )
        return torch.zeros(allowed.shape, dtype=q.dtype, device=device).masked_fill_(~allowed, float("-inf"))
