"""One data source of a recipe prepared (``pretrain prepare``): ``prepare`` in this process, or
``executors.prepare_in_tasks`` over datatrove tasks, and the line that reports it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pretrain.datamodules.prepare import prepare

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pretrain.datamodules.prepare import CorpusSettings


def prepare_source(
    name: str,
    text: Sequence[str],
    tokenizer: str | os.PathLike,
    prepared: str | os.PathLike,
    *,
    workers: int = 0,
    executor: Literal["local", "slurm", "ray"] | None = None,
    tasks: int | None = None,
    executor_options: dict[str, Any] | None = None,
    force: bool = False,
    **settings: Unpack[CorpusSettings],
) -> str:
    """Tokenize source ``name``'s ``text`` into ``prepared``: with ``workers`` processes (0: this one), or under
    ``executor`` in ``tasks`` datatrove tasks, ``workers`` at a time (0: all). The line that reports it: tokens
    and documents per split and what was dropped, or the SLURM tasks still pending."""
    if executor is None:
        meta = prepare(list(text), tokenizer, prepared, num_workers=workers, force=force, **settings)
    else:
        from pretrain.datamodules.executors import prepare_in_tasks

        meta = prepare_in_tasks(
            list(text),
            tokenizer,
            prepared,
            executor=executor,
            tasks=tasks or 1,
            workers=workers or -1,
            executor_options=executor_options or {},
            force=force,
            **settings,
        )
        if meta.get("submitted"):
            return (
                f"submitted {name}: {meta['stage']} tasks {meta['tasks_pending']} pending under SLURM "
                f"(logs in {meta['staging']}); rerun this command once they finish: it goes on to the next "
                f"stage or assembles {prepared}"
            )
    counts = ", ".join(
        f"{k} {v['tokens']:,} tokens / {v['documents']:,} documents" for k, v in meta["splits"].items()
    )
    dropped = [
        f"{meta.get(key, 0):,} {what}"
        for key, what in (("duplicates_dropped", "exact duplicates"), ("null_texts", "null texts"))
        if meta.get(key)
    ]
    return f"prepared {name} -> {prepared}: {counts}" + (
        f" (dropped {', '.join(dropped)})" if dropped else ""
    )
