"""``pretrain prepare RECIPE [key=value ...] [--workers N] [--executor local|slurm|ray]``: raw text -> token shards."""

from __future__ import annotations

import argparse

from pretrain import config
from pretrain.cli.common import recipe_arguments
from pretrain.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe_arguments(p)
    p.add_argument("--force", action="store_true", help="overwrite prepared data")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizing processes (default 0: this process, with the tokenizer's threads); same output. With "
        "--executor: tasks run at a time (default: all)",
    )
    p.add_argument(
        "--executor",
        choices=["local", "slurm", "ray"],
        help="split the corpus into --tasks datatrove tasks (local processes, a SLURM job array, a Ray cluster: "
        "RAY_ADDRESS or a local one); a rerun redoes only failed tasks; same tokens as plain prepare",
    )
    p.add_argument("--tasks", type=int, help="tasks of --executor (files are split among them; default 1)")
    p.add_argument("--partition", help="SLURM partition of --executor slurm (default: local)")
    p.add_argument("--time", help="SLURM time limit per task of --executor slurm (default 24:00:00)")


def main(args: argparse.Namespace) -> int:
    run, _ = config.load(args.recipe, args.overrides)
    if args.tasks is not None and args.executor is None:
        raise InputError("--tasks needs --executor local|slurm|ray (plain prepare uses --workers)")
    if args.tasks is not None and args.tasks < 1:
        raise InputError(
            f"--tasks must be >= 1 (the number of datatrove tasks the corpus is split into), got {args.tasks}"
        )
    if args.workers < 0:
        raise InputError(
            f"--workers must be >= 0 (0: {'all tasks at once' if args.executor else 'this process'}), got {args.workers}"
        )
    for source in run.data.sources:
        if not source.text:
            raise InputError(f"data source {source.name!r} lists no raw text (data.sources[].text)")
    from pretrain.config.run import corpus_settings
    from pretrain.datamodules.corpus import InvalidUTF8Error, MissingInput
    from pretrain.datamodules.sources import prepare_source

    options = {k: v for k, v in (("partition", args.partition), ("time", args.time)) if v}
    for i, source in enumerate(run.data.sources):
        try:
            report = prepare_source(
                source.name,
                source.text,
                run.tokenizer.path,
                source.prepared,
                workers=args.workers,
                executor=args.executor,
                tasks=args.tasks,
                executor_options=options,
                force=args.force,
                **corpus_settings(run, source),
            )
        except InvalidUTF8Error as err:
            raise InputError(err.with_fix("data.on_invalid_utf8")) from None
        except MissingInput as err:
            raise MissingInput(f"data.sources[{i}].text (source {source.name!r}): {err}") from None
        print(report)
    return 0
