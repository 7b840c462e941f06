"""Encoder-decoder examples of packed documents, laid out as seqio packs them (``seqio.utils.trim_and_pack_dataset``
and the feature converters): each document of a row is one example, turned into ``(inputs, targets)`` by an
objective, and the examples are packed back to back into the row's fixed encoder and decoder lengths::

    input_ids            a1 a2 a3 </s> b1 b2 </s> pad      document_ids          0 0 0 0 1 1 1 -1
    labels               t1 t2 </s> u1 </s> -100 ...       decoder_document_ids  0 0 0 1 1 -1 ...
    decoder_input_ids    0  t1 t2   0  u1   pad            (targets shifted right inside each document)
    position_ids, decoder_position_ids: 0 at every document's first token

so the decoder of document d attends causally to its own targets and cross-attends to its own inputs only.
Padding has document id -1 (its attention mask 0, its labels -100).

``fit_length`` is the budget rule: a document gets the longest raw prefix (at most ``cap``) whose example still fits
what the row has left; a document that does not fit whole is cut there and the row's later documents are dropped
(their tokens are not trained on in this sample).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from pretrain.objectives.base import document_spans, shift_right
from pretrain.objectives.loss import IGNORE_INDEX

Example = tuple[Tensor, Tensor]  # (encoder inputs (S_d,), decoder targets (T_d,)) of one document
# (document tokens, encoder room, decoder room, generator) -> (example, document tokens used), None: none fit
FitDocument = Callable[[Tensor, int, int, torch.Generator], tuple[Example, int] | None]


def fit_length(n: int, cap: int, fits: np.ndarray) -> int:
    """The longest length ``k <= min(n, cap)`` with ``fits[k]`` (``fits[0]`` False); 0 when none fits."""
    ok = np.flatnonzero(fits[1 : min(n, cap) + 1])
    return int(ok[-1]) + 1 if len(ok) else 0


def _packed_row(pieces: Sequence[Tensor], length: int, fill: int) -> tuple[Tensor, Tensor, Tensor]:
    """``pieces`` back to back in ``length`` slots: tokens padded with ``fill``, document ids (-1 on padding),
    positions (0 on padding)."""
    tokens = torch.full((length,), fill, dtype=torch.long)
    documents = torch.full((length,), -1, dtype=torch.long)
    positions = torch.zeros(length, dtype=torch.long)
    at = 0
    for d, piece in enumerate(pieces):
        n = len(piece)
        tokens[at : at + n] = piece
        documents[at : at + n] = d
        positions[at : at + n] = torch.arange(n)
        at += n
    return tokens, documents, positions


def pack_examples(
    rows: Sequence[Sequence[Example]], input_length: int, target_length: int, pad_id: int, start_id: int
) -> dict[str, Tensor]:
    """Each row's per-document examples (they fit: ``fit_length``) -> the model's keyword arguments and labels
    (module docstring; decoder inputs start with ``start_id`` in every document, T5: pad)."""
    out: dict[str, list[Tensor]] = {k: [] for k in ("enc", "enc_doc", "enc_pos", "dec", "dec_doc", "dec_pos")}
    for examples in rows:
        encoder = _packed_row([e for e, _ in examples], input_length, pad_id)
        decoder = _packed_row([t for _, t in examples], target_length, IGNORE_INDEX)
        for key, value in zip(out, (*encoder, *decoder), strict=True):
            out[key].append(value)
    batch = {k: torch.stack(v) for k, v in out.items()}
    decoder_inputs = shift_right(batch["dec"], start_id, pad_id)  # as unpacked; then start every document
    decoder_inputs[(batch["dec_pos"] == 0) & (batch["dec_doc"] >= 0)] = start_id
    return {
        "input_ids": batch["enc"],
        "attention_mask": (batch["enc_doc"] >= 0).long(),
        "document_ids": batch["enc_doc"],
        "position_ids": batch["enc_pos"],
        "labels": batch["dec"],
        "decoder_input_ids": decoder_inputs,
        "decoder_attention_mask": (batch["dec_doc"] >= 0).long(),
        "decoder_document_ids": batch["dec_doc"],
        "decoder_position_ids": batch["dec_pos"],
    }


def pack_documents(
    tokens: Tensor,
    document_ids: Tensor,
    generators: Sequence[torch.Generator],
    lengths: tuple[int, int],
    fit: FitDocument,
    pad_id: int,
    decoder_start_id: int,
) -> dict[str, Tensor]:
    """Every row's documents (``tokens``, ``document_ids`` (B, L)) made examples in order by ``fit`` with the
    room left in the row's encoder and decoder ``lengths``; a document cut to fit (or none fitting) fills the row.
    The rows then laid out by ``pack_examples``."""
    rows = []
    for row, documents, generator in zip(tokens, document_ids, generators, strict=True):
        examples: list[Example] = []
        room_in, room_out = lengths
        for start, end in document_spans(documents):
            fitted = fit(row[start:end], room_in, room_out, generator)
            if fitted is None:
                break
            example, n = fitted
            examples.append(example)
            room_in, room_out = room_in - len(example[0]), room_out - len(example[1])
            if n < end - start:  # cut: the row is full
                break
        rows.append(examples)
    return pack_examples(rows, *lengths, pad_id, decoder_start_id)
