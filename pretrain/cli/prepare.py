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
    from pretrain.datamodules.corpus import InvalidUTF8Error
    from pretrain.datamodules.prepare import prepare

    for source in run.data.sources:
        settings = {
            "val_fraction": run.data.val_fraction,
            "document": source.document,
            "text_field": source.text_field,
            "on_invalid_utf8": run.data.on_invalid_utf8,
            "eos_token": run.tokenizer.special_tokens.get("eos"),
            "dedup": source.dedup,
            "force": args.force,
        }
        try:
            if args.executor is None:
                meta = prepare(
                    list(source.text),
                    run.tokenizer.path,
                    source.prepared,
                    num_workers=args.workers,
                    **settings,
                )
            else:
                from pretrain.datamodules.executors import prepare_in_tasks

                options = {k: v for k, v in (("partition", args.partition), ("time", args.time)) if v}
                meta = prepare_in_tasks(
                    list(source.text),
                    run.tokenizer.path,
                    source.prepared,
                    executor=args.executor,
                    tasks=args.tasks or 1,
                    workers=args.workers or -1,
                    executor_options=options,
                    **settings,
                )
                if meta.get("submitted"):
                    print(
                        f"submitted {source.name}: {meta['stage']} tasks {meta['tasks_pending']} pending under SLURM "
                        f"(logs in {meta['staging']}); rerun this command once they finish: it goes on to the next "
                        f"stage or assembles {source.prepared}"
                    )
                    continue
        except InvalidUTF8Error as err:
            raise InputError(err.with_fix("data.on_invalid_utf8")) from None
        counts = ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['documents']:,} documents" for k, v in meta["splits"].items()
        )
        dropped = [
            f"{meta.get(key, 0):,} {what}"
            for key, what in (("duplicates_dropped", "exact duplicates"), ("null_texts", "null texts"))
            if meta.get(key)
        ]
        print(
            f"prepared {source.name} -> {source.prepared}: {counts}"
            + (f" (dropped {', '.join(dropped)})" if dropped else "")
        )
    return 0
