"""Context parallelism: every sample's sequence split over the N ranks of a group, attention computed by each
rank for its own queries against the keys and values of the whole sequence (Llama 3's all-gather design, Dubey
et al. 2024, sec. 3.3.2), on torch's functional collectives, so it runs wherever they run (gloo on the CPU
included; torch's own ``context_parallel`` needs a GPU attention kernel, pytorch/pytorch#147793).

Layout, load-balanced for causal masks: the T positions are cut into 2N chunks of T / 2N; rank r holds chunks r
and 2N-1-r (in that order), T / N positions. Under a causal mask a query at position p reads p + 1 keys, so an
early and a late chunk together give every rank the same number of (query, key) pairs. Bidirectional stacks use
the same layout (any layout balances them).

Per attention call (``pretrain.models.attention.attend`` with a mask built here)::

    K, V = natural_order(all_gather_N(K_r, V_r))                (B, g, T, d_h): every rank's keys, positions 0..T-1
    y_r  = softmax(Q_r K^T * scale + bias(p_q, k) + mask(p_q, k)) V     Q_r (B, h, T/N, d_h), y_r (B, h, T/N, d_h)

with p_q the global position of each local query (:func:`chunk_positions`). The mask is the model's own
``mask_mod`` evaluated at (p_q, k): causal, sliding window, prefix-LM, packed documents, key padding, global
tokens, T5's relative bias, all unchanged; the per-token tensors it reads on the key side (key padding, document
ids, global tokens; T5's positions for its bias) are all-gathered like K and V. The all-gather's backward is a
reduce-scatter (sum), so a rank's K and V receive the gradients of every rank's queries.

Everything else is per token and runs on the local T / N positions: embeddings at the global position ids, norms,
MLPs, the LM head and the loss (a sum over local targets; ``pretrain.training.step`` divides by the global count).
The batch is cut on the data side (:class:`SequenceShard`, in the DataLoader's workers), the model hooked from
outside (:func:`apply_context_parallel`, as torchtitan applies its parallelisms).

T5: the encoder's and the decoder's sequences are both split; cross-attention reads the decoder's local queries
against the all-gathered encoder keys and values. The decoder side of an encoder-decoder batch is padded at its
end to a multiple of 2N (labels ignored): under the causal mask no real position reads a padded one, so the loss
is exactly the unpadded one.

Why all-gather and not a ring (ring attention, Megatron-LM's CP): the all-gather is one collective per layer that
overlaps nothing but needs no custom attention kernel or online-softmax merge; K and V are g / h of the
activations (GQA), and torch's functional collectives give it autograd and gloo support. Its cost: each rank holds
the whole sequence's K and V of the layer being computed (and, saved for backward, of every layer).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, overload

import torch
from torch import Tensor, nn

from pretrain.objectives.loss import IGNORE_INDEX

# Padding of an encoder-decoder batch's decoder side (the keys of the model's forward and ``labels``)
DECODER_PADDING = {
    "decoder_input_ids": 0,  # any real token id: padded positions are read by no real one (causal)
    "decoder_attention_mask": 0,
    "decoder_position_ids": 0,
    "decoder_document_ids": -1,
    "labels": IGNORE_INDEX,
}
# Attention masks that mask nothing are dropped on the whole batch, before it is cut, so that every rank of a group
# agrees whether there is one (each all-gathers it)
KEY_MASKS = ("attention_mask", "decoder_attention_mask")


def chunk_positions(seq_len: int, rank: int, size: int) -> Tensor:
    """(seq_len / size,) the global positions rank ``rank`` of ``size`` holds: chunks rank and 2 size - 1 - rank
    of seq_len / (2 size) positions each. A new tensor per call (the cache holds integers: a cached tensor made
    under a fake mode, as ``pretrain plan`` traces, would be fake for every later caller)."""
    return torch.tensor(_chunk_positions(seq_len, rank, size))


def natural_order(seq_len: int, size: int) -> Tensor:
    """(seq_len,) index into the concatenation of every rank's positions (rank 0's first) that puts them in
    order 0..seq_len-1."""
    return torch.tensor(_natural_order(seq_len, size))


@functools.lru_cache(maxsize=64)
def _chunk_positions(seq_len: int, rank: int, size: int) -> tuple[int, ...]:
    if seq_len % (2 * size):
        raise ValueError(
            f"a sequence of {seq_len} positions does not split into 2 x context_parallel = {2 * size} chunks"
        )
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return (*range(first, first + chunk), *range(second, second + chunk))


@functools.lru_cache(maxsize=64)
def _natural_order(seq_len: int, size: int) -> tuple[int, ...]:
    held = [p for r in range(size) for p in _chunk_positions(seq_len, r, size)]
    return tuple(sorted(range(seq_len), key=held.__getitem__))


@dataclass(frozen=True)
class SequenceShard:
    """The data side: a collated batch cut to rank ``rank``'s positions of a group of ``size`` (picklable: it runs
    in the DataLoader's workers). Every tensor of two or more axes is a per-token one, cut along axis 1; (B,)
    tensors (prefix lengths) are kept. The encoder-decoder's decoder side is padded first (module docstring)."""

    rank: int
    size: int

    def __call__(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        batch = {k: v for k, v in batch.items() if not (k in KEY_MASKS and bool(v.all()))}
        if "decoder_input_ids" in batch:
            batch = self._pad_decoder(batch)
        out = {}
        for key, value in batch.items():
            if value.dim() < 2:
                out[key] = value
                continue
            length = value.shape[1]
            if length % (2 * self.size):
                raise ValueError(
                    f"batch key {key!r} has {length} positions, not a multiple of 2 x the {self.size} ranks of "
                    f"the context-parallel group = {2 * self.size}; pick a data.seq_len that is one"
                )
            out[key] = value.index_select(1, chunk_positions(length, self.rank, self.size)).contiguous()
        return out

    def _pad_decoder(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        length = batch["decoder_input_ids"].shape[1]
        extra = -length % (2 * self.size)
        if not extra:
            return batch
        padded = dict(batch)
        for key, fill in DECODER_PADDING.items():
            if key in batch:
                value = batch[key]
                padded[key] = torch.cat((value, value.new_full((value.shape[0], extra), fill)), dim=1)
        return padded


class ContextParallel:
    """The model side: one rank of a context-parallel process group, holding :func:`chunk_positions` of every
    sequence. Set on each stack of a :class:`pretrain.models.transformer.Transformer` by
    :func:`apply_context_parallel`; the stack asks it for its queries' positions and its mask's key-side tensors,
    and attention for the whole sequence's keys and values (:meth:`gather`)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, size={self.size})"

    def positions(self, local_len: int, device: torch.device) -> Tensor:
        """(T/N,) the global positions of this rank's ``local_len`` = T/N tokens."""
        return chunk_positions(local_len * self.size, self.rank, self.size).to(device)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """``x`` (..., T/N, ...) this rank's positions along ``dim`` -> (..., T, ...) every rank's, in order;
        differentiable (the backward reduce-scatters the gradient)."""
        from pretrain.compat.collectives import all_gather

        gathered = all_gather(x.contiguous(), dim, self.group)
        order = natural_order(x.shape[dim] * self.size, self.size).to(x.device)
        return gathered.index_select(dim, order)

    def gather_keys(self, x: Tensor) -> Tensor:
        """Keys or values (B, g, T/N, d_h) -> (B, g, T, d_h)."""
        return self.gather(x, 2)

    @overload
    def gather_tokens(self, x: Tensor) -> Tensor: ...
    @overload
    def gather_tokens(self, x: None) -> None: ...
    def gather_tokens(self, x: Tensor | None) -> Tensor | None:
        """A per-token tensor without gradient (B|1, T/N) -> (B|1, T) (bool travels as uint8)."""
        if x is None:
            return None
        with torch.no_grad():
            if x.dtype == torch.bool:
                return self.gather(x.to(torch.uint8), 1).bool()
            return self.gather(x, 1)

    def global_keys(self, inputs: Any, device: torch.device) -> Any:
        """A stack's ``MaskInputs`` for this rank's queries (at their global positions) against the whole
        sequence's keys: its key-side tensors all-gathered. Cross-attention's (against the encoder's keys) keep
        their query-side tensors local."""
        key_fields = (
            ("key_mask", "key_document_ids")
            if inputs.cross
            else ("key_mask", "document_ids", "global_ids", "prefix_keys")
        )
        changes: dict[str, Tensor | int | tuple[int, int] | None] = {
            name: self.gather_tokens(getattr(inputs, name)) for name in key_fields
        }
        changes["key_len"] = inputs.key_len * self.size
        if not inputs.cross:
            changes["query_positions"] = self.positions(inputs.query_len, device)
            chunk = inputs.query_len // 2  # chunks rank and 2N-1-rank (chunk_positions)
            changes["query_chunks"] = (self.rank * chunk, (2 * self.size - 1 - self.rank) * chunk)
        return dataclasses.replace(inputs, **changes)


class ContextParallelStack(Protocol):
    """A module that takes a ``context_parallel`` (the transformer's ``Stack``: its encoder and decoder)."""

    context_parallel: ContextParallel | None


def _is_stack(module: nn.Module) -> TypeGuard[ContextParallelStack]:
    return hasattr(module, "context_parallel")


def stacks(model: nn.Module) -> Iterable[ContextParallelStack]:
    """The modules of ``model`` that take a ``context_parallel`` (the transformer's encoder and decoder stacks)."""
    return (m for m in model.modules() if _is_stack(m))


def apply_context_parallel(model: nn.Module, group: Any) -> None:
    """Split every stack of ``model`` over the context-parallel process ``group`` (in place; parameters are
    untouched, so data parallelism / FSDP and tensor parallelism compose with it)."""
    for stack in stacks(model):
        stack.context_parallel = ContextParallel(group)
