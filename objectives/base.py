"""The interface every pretraining objective implements, and the helpers they share.

An objective is a pure, seeded function of a packed batch of raw token ids ``(B, L)``: it returns the model
inputs and the targets as a dict keyed like ``Transformer.forward``'s keyword arguments plus ``labels``
(``-100`` = nothing predicted), and it owns its loss and metrics.

Seeding is per sample: every row draws its randomness from its own ``torch.Generator``, so a row's result
depends only on its tokens and its generator, never on the other rows of the batch (the datamodule seeds one
generator per (seed, epoch, sample index), making results independent of batch size and worker count). A
single generator is also accepted; it then seeds one generator per row.

Packed documents (``data.document_mask``; ``docs/data.md``): with ``document_ids (B, L)`` -- each raw token's
document, 0 for the first of the row, from the prepared corpus's document lengths, never from a token id -- an
objective keeps every document to itself: it returns ``document_ids`` and ``position_ids`` (restarting at 0 in each
document) for the model's block masks, and draws its randomness document by document where the objective is
defined per example (span corruption, prefix LM, UL2: each document is an example, as seqio packs them). A row
holding a single document gives exactly the batch of the objective without document ids.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from pretrain.datamodules.special_tokens import (
    DEFAULT_SPECIAL_TOKENS,
    NUM_SENTINELS,
    UL2_MODE_TOKENS,
    TokenLookup,
    sentinel_token,
    special_token_id,
)
from pretrain.errors import InputError
from pretrain.objectives.loss import IGNORE_INDEX, num_correct, token_cross_entropy

ARCHITECTURES = frozenset({"decoder", "encoder", "encoder-decoder"})
Generators = torch.Generator | Sequence[torch.Generator]


def row_generators(generator: Generators, batch_size: int) -> list[torch.Generator]:
    """One generator per row: the given list, or ``batch_size`` generators seeded from one generator."""
    if isinstance(generator, torch.Generator):
        seeds = torch.randint(0, 2**62, (batch_size,), generator=generator).tolist()
        return [torch.Generator().manual_seed(s) for s in seeds]
    generators = list(generator)
    if len(generators) != batch_size:
        raise ValueError(
            f"got {len(generators)} generators for a batch of {batch_size} rows; pass one per row"
        )
    return generators


def rand_rows(generators: Sequence[torch.Generator], n: int) -> Tensor:
    """``(B, n)`` uniforms in [0, 1); row b is drawn from ``generators[b]`` alone."""
    if not generators:
        return torch.empty(0, n)
    return torch.stack([torch.rand(n, generator=g) for g in generators])


def document_starts(document_ids: Tensor) -> Tensor:
    """``(B, T)`` bool: the first token of each document (the row's first token included)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: Tensor) -> Tensor:
    """``(B, T)`` position of each token in its document: 0 at every document's first token."""
    index = torch.arange(document_ids.shape[1]).expand_as(document_ids)
    start = torch.where(document_starts(document_ids), index, torch.zeros_like(index)).cummax(1).values
    return index - start


def document_spans(document_ids: Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the documents of one row ``(T,)``, in order."""
    starts = document_starts(document_ids[None])[0].nonzero().squeeze(1).tolist()
    return list(zip(starts, [*starts[1:], len(document_ids)], strict=True))


def lookup(table: Tensor, ids: Tensor) -> Tensor:
    """``table[ids]`` for a 1-D table (index_select on the flat ids: several times faster than indexing)."""
    return table.index_select(0, ids.reshape(-1)).view(ids.shape)


def shift_right(labels: Tensor, start_id: int, pad_id: int) -> Tensor:
    """Decoder inputs ``(B, T)``: ``[start, labels[:-1]]`` with ignored positions replaced by pad (as T5)."""
    shifted = labels.new_full(labels.shape, pad_id)
    shifted[:, 0] = start_id
    shifted[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORE_INDEX, pad_id)
    return shifted


def count_sentinels(tokenizer: TokenLookup, limit: int = 10 * NUM_SENTINELS) -> int:
    """How many of ``<extra_id_0>``, ``<extra_id_1>``, ... the tokenizer has, looked up by name."""
    n = 0
    while n < limit and tokenizer.token_to_id(sentinel_token(n)) is not None:
        n += 1
    return n


def special_id_table(tokenizer, overrides: Mapping[str, str] | None = None) -> Tensor:
    """``(V,)`` bool: ids of every special token (roles, sentinels, UL2 modes, the tokenizer's own specials)."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    table = torch.zeros(vocab_size, dtype=torch.bool)
    names = [*DEFAULT_SPECIAL_TOKENS.values(), *(overrides or {}).values(), *UL2_MODE_TOKENS.values()]
    names += [sentinel_token(i) for i in range(count_sentinels(tokenizer))]
    ids = [tokenizer.token_to_id(name) for name in names]
    ids += [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    table[[i for i in ids if i is not None and i < vocab_size]] = True
    return table


class Objective(abc.ABC):
    """Base class: subclasses set ``name``/``architectures`` and implement ``raw_length`` and ``prepare``."""

    name: ClassVar[str]
    architectures: frozenset[str]
    reports_perplexity: ClassVar[bool] = False
    document_mask: ClassVar[bool] = (
        True  # keeps packed documents apart given document_ids (prepare_documents)
    )
    # few positions carry a target (MLM ~15 %, the prefix LM suffix): the trainer then runs the LM head on the
    # target positions only (``Transformer.forward(target_positions=...)``); dense targets skip the gather
    sparse_targets: ClassVar[bool] = False

    def __init__(self, tokenizer: TokenLookup, special_tokens: Mapping[str, str] | None = None):
        self.tokenizer = tokenizer
        self.special_tokens = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
        self.required_tokens: tuple[str, ...] = ()

    def token_id(self, role: str) -> int:
        """Id of the token playing ``role``; records it in ``required_tokens``; ValueError if missing."""
        token_id = special_token_id(self.tokenizer, role, self.special_tokens)
        if self.special_tokens[role] not in self.required_tokens:
            self.required_tokens += (self.special_tokens[role],)
        return token_id

    def check_architecture(self, arch: str) -> None:
        """ValueError unless a model of architecture ``arch`` can be trained with this objective."""
        if arch not in self.architectures:
            raise InputError(
                f"objective {self.name!r} needs a model with arch in {sorted(self.architectures)}, got "
                f"arch={arch!r}; change model.arch or pick an objective for {arch!r}"
            )

    @abc.abstractmethod
    def raw_length(self, input_length: int) -> int:
        """Raw tokens consumed per sample for a model input (encoder input) length ``input_length``."""

    @abc.abstractmethod
    def prepare(self, tokens: Tensor, generators: list[torch.Generator]) -> dict[str, Tensor]:
        """The objective proper on validated ``tokens (B, L)`` with one generator per row."""

    def prepare_documents(
        self, tokens: Tensor, generators: list[torch.Generator], document_ids: Tensor
    ) -> dict[str, Tensor]:
        """``prepare`` with every document of the rows kept to itself (module docstring); ``document_ids (B, L)``
        start at 0 in every row and never decrease."""
        raise NotImplementedError(f"objective {self.name!r} cannot keep packed documents apart")

    def __call__(
        self, tokens: Tensor, generator: Generators, document_ids: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Model inputs and ``labels`` for ``tokens (B, L)`` (int64); see the class docstring for keys. With
        ``document_ids (B, L)`` (any per-row ids that never decrease) every document is kept to itself."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor (B, L), got {tuple(tokens.shape)} {tokens.dtype}")
        generators = row_generators(generator, tokens.shape[0])
        if document_ids is None:
            return self.prepare(tokens, generators)
        if document_ids.shape != tokens.shape or (document_ids.diff(dim=1) < 0).any():
            raise ValueError(
                f"document_ids must be (B, L) = {tuple(tokens.shape)} and never decrease along a row, got "
                f"{tuple(document_ids.shape)}"
            )
        return self.prepare_documents(tokens, generators, (document_ids - document_ids[:, :1]).long())

    def loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of token cross-entropy over targets, number of targets)``; divide by the global count."""
        return token_cross_entropy(logits, labels)

    def metrics(self, logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """Summable counts: ``loss_sum``, ``num_targets``, ``num_correct`` (argmax == label on targets)."""
        loss_sum, num_targets = self.loss(logits, labels)
        correct = num_correct(logits.detach(), labels)
        return {"loss_sum": loss_sum.detach(), "num_targets": num_targets, "num_correct": correct}

    def summarize(self, totals: Mapping[str, Tensor]) -> dict[str, float]:
        """:func:`summarize_sums` of this objective (``perplexity`` for LM objectives)."""
        return summarize_sums(totals, self.reports_perplexity)


def summarize_sums(totals: Mapping[str, Tensor | float], perplexity: bool) -> dict[str, float]:
    """Global ``loss``, ``accuracy`` (and ``perplexity``) from ``loss_sum``, ``num_targets`` and ``num_correct``
    summed over micro-batches (and ranks). With no target at all they are undefined: NaN, never a loss of 0 that
    would read as a perfect model."""
    n = float(totals["num_targets"])
    loss = float(totals["loss_sum"]) / n if n > 0 else math.nan
    out = {"loss": loss, "accuracy": float(totals["num_correct"]) / n if n > 0 else math.nan}
    if perplexity:
        out["perplexity"] = float(torch.tensor(loss).exp())
    return out
