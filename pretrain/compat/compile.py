"""Every use of torch.compile's private internals, in one place (tested with torch 2.13.0; revisit on upgrades).

- ``CompileCounts``: graph breaks, compiled graphs and recompilations since a reset, read from dynamo's
  ``torch._dynamo.utils.counters`` and its per-frame compilation metrics (``recompile_reason`` is set on every
  compilation of a frame that already had a cached graph), the numbers ``TORCH_LOGS=graph_breaks,recompiles``
  prints.
- ``mark_dynamic``: ``torch._dynamo.maybe_mark_dynamic``, one axis of an input compiled as a symbolic size from
  the first call on, so a varying length (the number of MLM targets) never recompiles.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CompileCounts:
    """Compilation events since construction (or ``reset``); ``reset`` also drops dynamo's cached graphs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        from torch._dynamo.utils import clear_compilation_metrics, counters

        torch._dynamo.reset()
        counters.clear()
        clear_compilation_metrics()

    @property
    def graph_breaks(self) -> int:
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values())

    @property
    def graph_break_reasons(self) -> list[str]:
        from torch._dynamo.utils import counters

        return list(counters["graph_break"])

    @property
    def graphs(self) -> int:
        """Graphs compiled (each frame's first compilation, plus every recompilation and resumed frame)."""
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    @property
    def recompile_reasons(self) -> list[str]:
        from torch._dynamo.utils import get_compilation_metrics

        return [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]

    @property
    def recompiles(self) -> int:
        return len(self.recompile_reasons)


def mark_dynamic(t: Tensor, dim: int) -> Tensor:
    """Compile ``t``'s axis ``dim`` as a symbolic size (no specialisation on its length); returns ``t``."""
    torch._dynamo.maybe_mark_dynamic(t, dim)
    return t
