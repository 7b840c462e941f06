"""Task heads on the shared backbone: sequence classification / regression, token classification, multiple choice.

Axes: B batch, C choices, T length, d model width, K labels. A sequence is summarised by one vector (B, d):

    first   h[:, 0]                          encoders (BERT's [CLS]); ``pooler`` = BERT's tanh(dense(h[:, 0]))
    last    h[b, last real token of b]       decoders: the only state that has seen the whole input (GPT-1's
                                             ``<extract>``, HF ``GPT2ForSequenceClassification``)
    mean    sum_t m[b,t] h[b,t] / sum_t m[b,t]   T5: the mean of the encoder output (Sentence-T5)

and the heads are ``dropout -> linear``, as in HF's ``BertFor*`` / ``GPT2ForSequenceClassification`` (same logits
given the same weights). Unpadded batches (``Packing``: examples packed into rows, kept apart by document ids; see
``pretrain.datamodules.unpadded``) pool each example from its own tokens: the same vectors as padded. ``TaskModel`` couples a backbone and a head; encoder-decoder models run their encoder only, and
the backbone's unused parts (LM head, T5 decoder, an unused pooler) are removed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from pretrain.errors import InputError
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


class Packing(NamedTuple):
    """Where a packed batch's examples sit (``pretrain.datamodules.unpadded``): document_ids, position_ids and
    example_ids (R, C), -1 on leftover slots; first, last (B,) flat indices of each example's first / last token."""

    document_ids: Tensor
    position_ids: Tensor
    example_ids: Tensor
    first: Tensor
    last: Tensor

    @classmethod
    def of(cls, batch: dict[str, Tensor]) -> Packing | None:
        """The packing of a batch from ``PackedCollate`` (None for a padded batch)."""
        if "example_ids" not in batch:
            return None
        keys = ("document_ids", "position_ids", "example_ids", "example_first", "example_last")
        return cls(*(batch[k] for k in keys))


def pool_packed(hidden: Tensor, packing: Packing, pooling: str) -> Tensor:
    """hidden (R, C, d) of a packed batch -> (B, d): each example's first / last token, or the mean of its own."""
    flat = hidden.flatten(0, 1)
    if pooling in ("first", "pooler"):
        return flat[packing.first]
    if pooling == "last":
        return flat[packing.last]
    if pooling == "mean":
        examples = packing.example_ids.flatten()
        real = examples >= 0
        sums = flat.new_zeros(len(packing.first), flat.shape[1]).index_add_(0, examples[real], flat[real])
        counts = flat.new_zeros(len(packing.first)).index_add_(
            0, examples[real], flat.new_ones(int(real.sum()))
        )
        return sums / counts.clamp_min(1.0)[:, None]
    raise ValueError(f"unknown pooling {pooling!r}")


KINDS = ("sequence", "token", "multiple_choice")
POOLINGS: dict[str, tuple[str, ...]] = {  # allowed poolings per architecture; the first one is the default
    "encoder": ("first", "pooler", "mean"),
    "decoder": ("last",),
    "encoder-decoder": ("mean", "first"),
}


def default_pooling(config: ModelConfig) -> str:
    """BERT with a pooler -> ``pooler``; else the first allowed pooling of the architecture."""
    return "pooler" if config.pooler else POOLINGS[config.arch][0]


def check_head(config: ModelConfig, kind: str, pooling: str) -> None:
    """``ValueError`` when a head does not fit the backbone (before any weights are touched)."""
    if kind not in KINDS:
        raise ValueError(f"head kind {kind!r} is not one of {list(KINDS)}")
    if kind == "token":
        return
    allowed = POOLINGS[config.arch]
    if pooling not in allowed:
        why = {
            "decoder": "a causal decoder's only state that has seen the whole input is the last one",
            "encoder": "encoders are summarised by their first token, BERT's pooler or the mean",
            "encoder-decoder": "T5 is summarised by its encoder output",
        }[config.arch]
        raise InputError(
            f"pooling {pooling!r} does not fit arch {config.arch!r} ({why}); use one of {list(allowed)}"
        )
    if pooling == "pooler" and not config.pooler:
        raise InputError("pooling 'pooler' needs a backbone with BERT's pooler (config.pooler); use 'first'")


def pool(hidden: Tensor, attention_mask: Tensor | None, pooling: str) -> Tensor:
    """hidden (B, T, d), attention_mask (B, T) 1 = real -> (B, d). ``last`` finds the last real token whatever
    the padding side (left-padded prompts too)."""
    if pooling == "first":
        return hidden[:, 0]
    mask = torch.ones(hidden.shape[:2], device=hidden.device) if attention_mask is None else attention_mask
    if pooling == "last":
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        last = (positions * mask.bool()).argmax(dim=1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling == "mean":
        m = mask.to(hidden.dtype)[..., None]
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    raise ValueError(f"unknown pooling {pooling!r}")


class SequenceHead(nn.Module):
    """pooled (B, d) -> dropout -> linear -> (B, K); K = 1 for regression."""

    def __init__(self, d_model: int, num_labels: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, num_labels, bias=bias)
        nn.init.normal_(self.out.weight, std=0.02)  # HF BERT/GPT-2 heads; bias 0
        if bias:
            nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.drop(x))


class TaskModel(nn.Module):
    """Backbone + head.

    forward(input_ids, attention_mask, token_type_ids) ->
        sequence:         (B, T)    -> (B, K)
        token:            (B, T)    -> (B, T, K)
        multiple_choice:  (B, C, T) -> (B, C)   (each choice scored by a shared linear(d, 1))
    """

    def __init__(
        self,
        backbone: Transformer,
        kind: str,
        num_labels: int,
        *,
        pooling: str | None = None,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        cfg = backbone.config
        pooling = pooling or default_pooling(cfg)
        check_head(cfg, kind, pooling)
        if kind == "multiple_choice":
            num_labels = 1
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        # parts a task head never uses are dropped (no wasted compute, no parameters without gradients)
        backbone.lm_head = backbone.mlm_transform = None
        if cfg.arch == "encoder-decoder":
            backbone.decoder = None
        if kind == "token" or pooling != "pooler":
            backbone.pooler = None
        self.backbone, self.kind, self.pooling = backbone, kind, pooling
        # GPT2ForSequenceClassification's `score` has no bias; BERT's classifier has one
        self.head = SequenceHead(cfg.d_model, num_labels, dropout, bias=cfg.arch != "decoder")

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        packing: Packing | None = None,
    ) -> Tensor:
        if packing is not None:
            return self._forward_packed(input_ids, attention_mask, token_type_ids, packing)
        choices = None
        if self.kind == "multiple_choice":
            if input_ids.dim() != 3:
                raise ValueError("multiple_choice inputs must be (B, C, T)")
            choices = input_ids.shape[1]
            input_ids = input_ids.flatten(0, 1)  # (B, C, T) -> (B*C, T)
            attention_mask, token_type_ids = (
                t.flatten(0, 1) if t is not None else None for t in (attention_mask, token_type_ids)
            )
        if self.backbone.config.arch == "encoder-decoder":  # T5: the encoder only
            hidden, pooled = self.backbone.encode(input_ids, attention_mask, token_type_ids), None
        else:
            out = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            hidden, pooled = out.hidden_states, out.pooled_output
        if self.kind == "token":
            return self.head(hidden)
        if self.pooling != "pooler":
            pooled = pool(hidden, attention_mask, self.pooling)
        logits = self.head(pooled)
        return logits.view(-1, choices) if choices is not None else logits

    def _forward_packed(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        packing: Packing,
    ) -> Tensor:
        """Sequence heads on a packed batch (R, C) -> (B, K)."""
        if self.kind != "sequence":
            raise ValueError(f"packed (unpadded) batches need a sequence head, got kind {self.kind!r}")
        where = {"document_ids": packing.document_ids, "position_ids": packing.position_ids}
        if self.backbone.config.arch == "encoder-decoder":
            hidden = self.backbone.encode(input_ids, attention_mask, token_type_ids, **where)
        else:
            out = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, **where
            )
            hidden = out.hidden_states
        pooled = pool_packed(hidden, packing, self.pooling)
        if self.pooling == "pooler":
            assert self.backbone.pooler is not None  # the head checks model.pooler for this pooling
            pooled = self.backbone.pooler(pooled[:, None])
        return self.head(pooled)
