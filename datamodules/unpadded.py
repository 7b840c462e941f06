"""Unpadded batches: a batch's examples packed into few rows, kept apart by document ids (no compute on padding).

A padded batch computes ``B * max(len)`` positions; here the examples are placed into rows by first-fit decreasing
(``first_fit``: longest first, each into the first row with room, in every stream at once -- the encoder and the
decoder of a text-to-text pair share a row), rows as long as the batch's longest example, and ``pack`` lays them
out::

    input_ids     a1 a2 a3 b1 b2 | c1 c2 c3 pad      document_ids  0 0 0 1 1 | 0 0 0 -1
    position_ids  0  1  2  0  1  | 0  1  2  0        example_ids   0 0 0 2 2 | 1 1 1 -1

so only the packing's leftover slots are computed beside the real tokens. The model keeps the documents apart
(``Transformer.forward(document_ids=, position_ids=)``: attention within a document, positions from 0), so every
example's outputs equal its padded ones; ``example_ids`` map tokens back to the batch's examples (pooling, labels).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def first_fit(sizes: Sequence[Sequence[int]], capacity: Sequence[int]) -> list[list[int]]:
    """Example indices per row: first-fit decreasing (by the first size) of examples of ``sizes[i]`` (one size per
    stream) into rows holding at most ``capacity`` of each; every example must fit a row alone."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i][0])
    rows: list[list[int]] = []
    room: list[list[int]] = []
    for i in order:
        for r, left in enumerate(room):
            if all(s <= c for s, c in zip(sizes[i], left, strict=True)):
                rows[r].append(i)
                room[r] = [c - s for s, c in zip(sizes[i], left, strict=True)]
                break
        else:
            rows.append([i])
            room.append([c - s for s, c in zip(sizes[i], capacity, strict=True)])
    return rows


def pack(
    sequences: Sequence[Sequence[int]], rows: list[list[int]], length: int, fill: int
) -> dict[str, Tensor]:
    """``sequences`` (one per example) laid out in ``rows`` (``first_fit``) of ``length`` slots: ``tokens``,
    ``document_ids`` (order within the row, -1 on leftover slots), ``position_ids`` (0 on leftover slots) and
    ``example_ids`` (the example's index, -1 on leftover slots), each (R, length), leftover tokens ``fill``."""
    shape = (len(rows), length)
    out = {
        "tokens": torch.full(shape, fill, dtype=torch.long),
        "document_ids": torch.full(shape, -1, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
        "example_ids": torch.full(shape, -1, dtype=torch.long),
    }
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = len(sequences[i])
            out["tokens"][r, at : at + n] = torch.as_tensor(sequences[i], dtype=torch.long)
            out["document_ids"][r, at : at + n] = d
            out["position_ids"][r, at : at + n] = torch.arange(n)
            out["example_ids"][r, at : at + n] = i
            at += n
    return out


def first_and_last(example_ids: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``(first, last)`` (count,) flat indices into ``example_ids.flatten()`` of each example's first and last
    token."""
    flat = example_ids.flatten()
    index = torch.arange(len(flat))
    real = flat >= 0
    first = torch.full((count,), len(flat), dtype=torch.long).scatter_reduce(
        0, flat[real], index[real], "amin"
    )
    last = torch.full((count,), -1, dtype=torch.long).scatter_reduce(0, flat[real], index[real], "amax")
    return first, last
