"""The recipe and checkpoint verbs: ``tokenizer``, ``prepare``, ``fit``, ``validate``, ``generate``, ``export``.

Each verb is ``add_<verb>_arguments(parser)`` plus ``cmd_<verb>(args) -> exit status``; ``pretrain.cli`` dispatches.
The config is loaded and validated before torch or Lightning is imported, so bad input is reported at once.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import tempfile
import warnings
from pathlib import Path
from typing import Any

from pretrain import config
from pretrain.config import RunConfig
from pretrain.errors import InputError


def cmd_fit(args: argparse.Namespace) -> int:
    run, resolved = config.load(args.recipe, args.overrides)
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(resolved), end="")
        print("".join(f"# {line}\n" for line in optimizer_groups(run).splitlines()), end="")
        return 0
    check_input_files(run)
    # with the GC schedule, no automatic collection during set-up either: importing torch and Lightning and
    # building the run makes ~350k long-lived objects, which Python's GC would scan in full ~6 times (~0.4 CPU-s)
    from pretrain.datamodules.storage import run_lock

    without_gc = bool(run.trainer.gc_every_n_steps) and gc.isenabled()
    if without_gc:
        gc.disable()
    try:
        with run_lock(run.run_dir, "`pretrain fit`"):  # one writer of the run's checkpoints and logs
            return _fit(args, run, resolved)
    finally:
        if without_gc:
            gc.enable()


def check_input_files(run: RunConfig) -> None:
    """``run_dir`` is no file; the tokenizer, every source's prepared corpus (each missing one named with the verb
    that makes it) and a ``resume`` checkpoint exist: checked before Lightning is imported."""
    from pretrain.config.run import check_resume_path
    from pretrain.datamodules.prepare import read_meta
    from pretrain.datamodules.tokenizer import load_tokenizer

    if Path(run.run_dir).exists() and not Path(run.run_dir).is_dir():
        raise InputError(f"run_dir={run.run_dir} is a file; give a directory (it is created if missing)")
    load_tokenizer(run.tokenizer.path)
    for source in run.data.sources:
        read_meta(source.prepared)
    check_resume_path(run)


def _fit(args: argparse.Namespace, run: RunConfig, resolved: dict[str, Any]) -> int:
    from pretrain.errors import RankDied, peer_gone
    from pretrain.training import lightning_compat  # first: Lightning without torchmetrics' extras
    from pretrain.training.checkpoint.reshard import CACHE, loadable, remove_cache
    from pretrain.training.preemption import Interrupted
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    parts = prepare_run(run, resolved)
    restore = parts["ckpt"]
    if restore is not None:
        if _finished(run, restore):
            return 0
        stage = run.strategy.deepspeed.stage if run.strategy.name == "deepspeed" else None
        world = run.trainer.devices * run.trainer.num_nodes
        restore = loadable(restore, run.strategy.name, world, stage, Path(run.run_dir) / CACHE)
    module = parts["module"]
    trainer = build_trainer(run, resolved, wandb_id=module.wandb_id)
    try:
        with warnings.catch_warnings():
            # Lightning looks for a stateful DataLoader only; the datamodule's own state restores the data
            # position exactly (datamodules/pretrain.py), so its warning on every mid-epoch resume is wrong here.
            warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch")
            trainer.fit(module, datamodule=parts["datamodule"], ckpt_path=restore, weights_only=True)
    except Interrupted as stop:
        if trainer.is_global_zero:
            again = [args.recipe, *(o for o in args.overrides if not o.startswith("resume=")), "resume=auto"]
            command = " ".join(["pretrain fit", *map(shlex.quote, again)])
            print(f"\n== pretrain fit: {stop} ==\n  continue with: {command}")
        return stop.exit_status
    except Exception as err:
        if not peer_gone(err):  # a collective failed: name the rank that died
            raise
        raise RankDied(lightning_compat.dead_ranks(trainer), trainer.global_rank, err) from err
    finally:
        if trainer.is_global_zero:
            remove_cache(run.run_dir)  # converted checkpoints: every rank loaded its state at the start
    last = run.checkpoint_dir / "last.ckpt"  # written after the last step by LastCheckpoint
    if trainer.is_global_zero:
        _summary(trainer, run, module, last if last.exists() else parts["ckpt"])
        if run.logger.csv and any((Path(run.run_dir) / "logs").glob("version_*/metrics.csv")):
            from pretrain.training.plots import plot_runs

            print(f"  curves: {plot_runs([run.run_dir], Path(run.run_dir) / 'curves.png')}")
    return 0


def optimizer_groups(run: RunConfig) -> str:
    """The optimizer's parameter groups for ``run`` (shapes only: the model is built on the meta device)."""
    import torch

    from pretrain.models.transformer import Transformer
    from pretrain.training.optim import build_optimizer, describe

    with torch.device("meta"):
        model = Transformer(run.model)
    return describe(build_optimizer(model, run.optim, width_mult=run.model.width_mult))


def _finished(run: RunConfig, ckpt: Path) -> bool:
    """A run already at ``trainer.max_steps``: say so (and how to train more) instead of training 0 steps."""
    from pretrain.training.checkpoint.resume import checkpoint_step

    step = checkpoint_step(ckpt)
    if step < run.trainer.max_steps:
        return False
    keep = ""
    if run.optim.decay_steps is None and run.optim.schedule in ("cosine", "linear", "wsd"):
        keep = f" with optim.decay_steps={run.trainer.max_steps} (the schedule it decayed over)"
    print(
        f"\n== pretrain fit: nothing to train ==\n  steps: {step} (run {run.name!r} already reached "
        f"trainer.max_steps={run.trainer.max_steps}; checkpoint: {ckpt})\n  to train it further raise "
        f"trainer.max_steps{keep}; for a new run set name=NEW (or resume=null to overwrite this one)"
    )
    return True


def cmd_plot(args: argparse.Namespace) -> int:
    from pretrain.training.plots import plot_runs

    print(f"curves of {len(args.run_dirs)} run(s) -> {plot_runs(args.run_dirs, args.out)}")
    return 0


def _summary(trainer: Any, run: RunConfig, module: Any, last: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    lines = [f"steps: {trainer.global_step} (tokens seen {module.tokens_seen:,})", f"checkpoint: {last}"]
    best = [
        cb.best_model_path
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.monitor and cb.best_model_path
    ]
    if best:
        lines.append(f"best checkpoint: {best[0]}")
    for name, value in sorted(trainer.callback_metrics.items()):
        if name.startswith("val/"):
            lines.append(f"{name}: {float(value):.4f}")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            experiment = logger.experiment
            run_dir = Path(experiment.dir).parent
            lines.append(
                f"W&B run: {experiment.id} ({'offline' if experiment.offline else 'online'}) {run_dir}"
            )
            if experiment.offline:
                lines.append(f"  upload with: wandb sync {run_dir}")
            wandb.finish()
        elif isinstance(logger, CSVLogger):
            csv_file = Path(logger.log_dir) / "metrics.csv"
            if csv_file.is_file():
                lines.append(f"metrics CSV: {csv_file}")
            else:
                lines.append(
                    f"metrics CSV: none (no step logged; trainer.log_every_n_steps={trainer.log_every_n_steps})"
                )
    print("\n== pretrain fit: done ==\n" + "\n".join(f"  {line}" for line in lines))


def existing_checkpoint(path: str, where: str) -> Path:
    """``path``, which a verb reads (``where``: its flag or argument), or the one line saying it does not exist."""
    if not Path(path).exists():
        raise FileNotFoundError(f"checkpoint {path} ({where}) does not exist")
    return Path(path)


def cmd_validate(args: argparse.Namespace) -> int:
    if args.ckpt:
        existing_checkpoint(args.ckpt, "--ckpt")
    overrides = list(args.overrides) + ([f"resume={args.ckpt}"] if args.ckpt else [])
    run, resolved = config.load(args.recipe, overrides)
    check_input_files(run)
    from pretrain.training import lightning_compat  # noqa: F401  (first: Lightning without torchmetrics' extras)
    from pretrain.training.checkpoint.resume import strategy_reads
    from pretrain.training.setup import prepare_run
    from pretrain.training.trainer import build_trainer

    parts = prepare_run(run, resolved, training=False)
    if parts["ckpt"] is None:
        raise FileNotFoundError(f"no checkpoint in {run.checkpoint_dir}; pass --ckpt PATH or train first")
    trainer = build_trainer(run, resolved, loggers=[])
    ckpt = parts["ckpt"]
    # a directory of another strategy, or any checkpoint under DeepSpeed (whose engine cannot load ZeRO-3 weights
    # without an optimizer): the consolidated weights are loaded before the strategy sets the model up
    if run.strategy.name == "deepspeed" or not strategy_reads(run.strategy.name, ckpt):
        from pretrain.training.checkpoint.convert import load_model

        parts["module"].model.load_state_dict(load_model(ckpt)[0].state_dict())
        ckpt = None
    results = trainer.validate(
        parts["module"], datamodule=parts["datamodule"], ckpt_path=ckpt, weights_only=True, verbose=False
    )
    if trainer.is_global_zero:
        print(f"checkpoint: {parts['ckpt']}")
        for name, value in sorted(results[0].items()):
            print(f"  {name}: {value:.4f}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    check_sampling_flags(args)
    existing_checkpoint(args.checkpoint, "generate CHECKPOINT")
    import torch

    from pretrain.models.generation import generate
    from pretrain.training.checkpoint.convert import load_model

    model, _, tokenizer = load_model(args.checkpoint)
    if tokenizer is None:
        raise InputError(f"{args.checkpoint} holds no tokenizer; cannot encode a text prompt")
    if model.config.arch == "encoder" or not model.config.lm_head:
        raise InputError(
            f"{args.checkpoint} is an encoder (model.arch={model.config.arch}): generate needs arch 'decoder' or "
            "'encoder-decoder' with an LM head; score an encoder with `pretrain evaluate` instead"
        )
    if args.compile:
        model.compile(dynamic=True)  # the cache grows every step: one graph with a symbolic length
    cfg = model.config
    from pretrain.datamodules.tokenizer import TextEncoder

    prompt = TextEncoder(tokenizer).encode(args.prompt)  # a prompt spelling "</s>" is that text, not EOS
    ids = torch.tensor([prompt] * args.num_samples, dtype=torch.long)
    if ids.shape[1] == 0 and cfg.arch == "decoder":
        raise InputError("the prompt is empty; pass --prompt TEXT")
    max_new_tokens = _max_new_tokens(cfg, ids.shape[1], args.max_new_tokens)
    eos = tokenizer.token_to_id(args.eos) if args.eos else None
    if args.eos and eos is None:
        raise InputError(
            f"--eos {args.eos!r} is not in the tokenizer's vocabulary; name one that is, or --eos ''"
        )
    generator = torch.Generator().manual_seed(args.seed)
    enc_dec = cfg.arch == "encoder-decoder"
    out = generate(
        model.eval(),
        None if enc_dec else ids,
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        eos_token_id=eos,
        generator=generator,
        encoder_input_ids=ids if enc_dec else None,
    )
    if enc_dec:
        print(span_filling_note(tokenizer, ids[0].tolist()))
    for i, row in enumerate(out.tolist()):
        text = tokenizer.decode(row if enc_dec else row[ids.shape[1] :], skip_special_tokens=not enc_dec)
        print(f"--- sample {i} ---\n{'' if enc_dec else args.prompt}{text}")
    return 0


DEFAULT_NEW_TOKENS = 100


def check_sampling_flags(args: argparse.Namespace) -> None:
    """``pretrain generate``'s numeric flags, named as flags (the library checks them under its own names)."""
    checks = [
        ("--num-samples", args.num_samples, args.num_samples >= 1, ">= 1"),
        (
            "--max-new-tokens",
            args.max_new_tokens,
            args.max_new_tokens is None or args.max_new_tokens >= 1,
            ">= 1",
        ),
        ("--temperature", args.temperature, args.greedy or args.temperature > 0, "> 0 (or --greedy)"),
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1"),
        ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
    ]
    for flag, value, ok, bound in checks:
        if not ok:
            raise InputError(f"{flag} must be {bound}, got {value}")


def span_filling_note(tokenizer: Any, prompt_ids: list[int]) -> str:
    """What an encoder-decoder (span corruption) model's output is, and a warning for a prompt with no sentinel."""
    note = (
        "(a span-corruption model returns the spans its input's sentinels stand for, each after its sentinel: "
        "<extra_id_0> span <extra_id_1> span ...)"
    )
    if not any((tokenizer.id_to_token(i) or "").startswith("<extra_id_") for i in prompt_ids):
        note += (
            "\n(the prompt has no sentinel, so there is nothing to fill: mark missing text with <extra_id_0>, "
            'e.g. --prompt "To be, or <extra_id_0> to be")'
        )
    return note


def _max_new_tokens(cfg: Any, prompt_len: int, requested: int | None) -> int:
    """``--max-new-tokens`` (default: 100, or what the position table leaves). A model with a position table
    (learned / sinusoidal) cannot go past ``max_seq_len``: say so before generating instead of failing after."""
    if cfg.position not in ("learned", "sinusoidal"):
        return requested or DEFAULT_NEW_TOKENS
    limit = cfg.max_seq_len
    room = limit - 1 if cfg.arch == "encoder-decoder" else limit - prompt_len
    max_new_tokens = requested or min(DEFAULT_NEW_TOKENS, max(room, 1))
    if cfg.arch == "encoder-decoder":
        if prompt_len > limit or max_new_tokens + 1 > limit:
            raise InputError(
                f"the prompt ({prompt_len} tokens) or --max-new-tokens {max_new_tokens} exceeds the model's "
                f"{limit} positions; shorten the prompt or use --max-new-tokens {limit - 1}"
            )
    elif prompt_len + max_new_tokens > limit:
        raise InputError(
            f"the prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's {limit} "
            f"positions (model.max_seq_len); use --max-new-tokens {max(limit - prompt_len, 0)} or a shorter prompt"
        )
    return max_new_tokens


def _check_export_target(out_dir: Path, force: bool) -> None:
    """An export goes into a new or empty directory (``--force``: overwrite the files it writes there)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file; export into a directory (it is created if missing)")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise InputError(
            f"{out_dir} is not empty; export into a new or empty directory, or pass --force to overwrite "
            f"the files the export writes there"
        )
    out_dir.mkdir(parents=True, exist_ok=True)  # PermissionError here names the directory
    with tempfile.TemporaryFile(dir=out_dir):  # and here, when it exists but may not be written
        pass


def cmd_export(args: argparse.Namespace) -> int:
    from pretrain.datamodules.storage import run_lock

    path = existing_checkpoint(args.checkpoint, "export CHECKPOINT")
    created = not Path(args.out_dir).exists()
    with run_lock(args.out_dir, "`pretrain export`"):
        try:
            return _export(args, path)
        except BaseException:
            if created and Path(args.out_dir).is_dir() and not any(Path(args.out_dir).iterdir()):  # no trace
                Path(args.out_dir).rmdir()
            raise


def _export(args: argparse.Namespace, path: Path) -> int:
    _check_export_target(Path(args.out_dir), args.force)  # under the lock, before the heavy imports
    from pretrain.finetuning.export import export_finetuned, is_finetuned
    from pretrain.models.hf import save_hf
    from pretrain.training.checkpoint import consolidate, read
    from pretrain.training.checkpoint.convert import load_model

    with tempfile.TemporaryDirectory() as tmp:
        single = consolidate(path, Path(tmp) / "consolidated.ckpt")  # a file is returned as it is
        if is_finetuned(read(single, mmap=True)) and not args.ema:  # `pretrain finetune`: LoRA merged
            out = export_finetuned(single, args.out_dir)
        else:
            model, info, tokenizer = load_model(path, ema=True) if args.ema else load_model(single)
            special_tokens = info.get("config", {}).get("tokenizer", {}).get("special_tokens")
            out = save_hf(model, args.out_dir, tokenizer, special_tokens)
    print(f"exported {args.checkpoint} -> {out} (transformers from_pretrained format)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """A checkpoint of any layout as one file, a DCP directory, or a Hugging Face model directory (``export``)."""
    if args.to == "hf":
        return cmd_export(
            argparse.Namespace(checkpoint=args.checkpoint, out_dir=args.out, force=False, ema=False)
        )
    from pretrain.training.checkpoint.stream import convert

    out = convert(args.checkpoint, args.to, args.out)
    print(f"converted {args.checkpoint} -> {out} ({args.to})")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """The weighted average of checkpoints' weights (``checkpoint.merge``) as one checkpoint file."""
    from pretrain.training.checkpoint.merge import merge, parse_weights

    weights = parse_weights(args.weights) if args.weights is not None else None
    out = merge(args.checkpoints, args.out, weights)
    print(f"merged {len(args.checkpoints)} checkpoints -> {out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from pretrain.datamodules.corpus import InvalidUTF8Error
    from pretrain.datamodules.tokenizer import train_bpe

    run, _ = config.load(args.recipe, args.overrides)
    t = run.tokenizer
    path = Path(t.path)
    if path.exists() and not args.force:
        from pretrain.datamodules.tokenizer import load_tokenizer

        try:
            load_tokenizer(path)
        except InputError as err:
            raise InputError(f"{err}; it may be truncated -- rerun with --force to retrain it") from err
        print(f"tokenizer {path} exists; reusing it (--force retrains)")
        return 0
    if not t.train_files:
        raise InputError(
            f"tokenizer {path} does not exist and tokenizer.train_files is empty; list training text"
        )
    try:
        tokenizer = train_bpe(
            list(t.train_files),
            t.vocab_size,
            path,
            min_frequency=t.min_frequency,
            on_invalid_utf8=t.on_invalid_utf8,
        )
    except InvalidUTF8Error as err:
        raise InputError(err.with_fix("tokenizer.on_invalid_utf8")) from None
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens -> {path}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
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


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. trainer.max_steps=100")


def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def add_validate_arguments(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--ckpt", help="checkpoint (default: the newest valid one of the run)")


def add_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--force", action="store_true", help="retrain even if the file exists")


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
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


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("checkpoint", help="a .ckpt written by `pretrain fit` (or a sharded checkpoint directory)")
    g.add_argument("--prompt", default="\n", help="prompt text (encoder input for encoder-decoder models)")
    g.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: 100, or what the position table leaves"
    )
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eos", default="</s>", help="stop token ('' to never stop early)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model first (see README)")


def add_export_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("checkpoint", help="a .ckpt (or a sharded FSDP/DeepSpeed checkpoint directory)")
    e.add_argument(
        "out_dir", help="output directory (config.json, model.safetensors, tokenizer); new or empty"
    )
    e.add_argument("--force", action="store_true", help="export into a non-empty directory, overwriting")
    e.add_argument(
        "--ema", action="store_true", help="export the weights' moving average (ema.decay) instead"
    )


def add_convert_arguments(c: argparse.ArgumentParser) -> None:
    from pretrain.training.checkpoint.stream import TARGETS

    c.add_argument("checkpoint", help="a checkpoint file, FSDP/async (DCP) or DeepSpeed checkpoint directory")
    c.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="single: one .ckpt file; dcp: a sharded (DCP) directory; hf: a transformers model directory",
    )
    c.add_argument("out", help="the new file or directory (must not exist; hf: new or empty)")


def add_merge_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("checkpoints", nargs="+", help="checkpoints of one model (files or sharded directories)")
    m.add_argument("--out", required=True, help="the merged checkpoint file (weights only)")
    m.add_argument("--weights", help="comma-separated, one per checkpoint, summing to 1 (default: uniform)")


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="run directories (holding logs/version_*/metrics.csv)")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
