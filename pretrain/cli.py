"""The ``pretrain`` command: ``fit``, ``validate``, ``generate``, ``export``, ``tokenizer``, ``prepare``, and the
later stages ``finetune``, ``evaluate`` and ``baseline``.

    pretrain tokenizer recipes/gpt-tiny.yaml                  # train the recipe's BPE tokenizer (or reuse it)
    pretrain prepare recipes/gpt-tiny.yaml                    # raw text -> token shards
    pretrain fit recipes/gpt-tiny.yaml trainer.max_steps=100  # train (resume=auto by default)
    pretrain validate recipes/gpt-tiny.yaml                   # validation loss of the newest checkpoint
    pretrain generate runs/gpt-tiny/checkpoints/last.ckpt --prompt "ROMEO:" --top-k 50
    pretrain export runs/gpt-tiny/checkpoints/last.ckpt runs/gpt-tiny/hf
    pretrain finetune recipes/finetune-sst2-minilm.yaml
    pretrain evaluate runs/gpt-tiny/checkpoints/last.ckpt --tasks copa --num-fewshot 3 --data-root DIR
    pretrain baseline recipes/lstm-lm-tiny.yaml

Recipe commands take ``key=value`` overrides after the recipe. Bad input exits with status 2 and one line
naming the problem, before any heavy work. New subcommands register in ``COMMANDS`` (handlers here) or
``EXTERNAL_COMMANDS`` (a module with ``add_arguments`` and a handler).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import secrets
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain import configs
from pretrain.configs import RunConfig

# ---------------------------------------------------------------------------------------------- set-up


def build_objective(run: RunConfig, tokenizer: Any) -> Any:
    """The configured objective, checked against the architecture and the tokenizer."""
    import objectives
    from datamodules.tokenizer import check_tokenizer

    options = dict(run.objective.options)
    if run.tokenizer.special_tokens and "special_tokens" in objectives.options(run.objective.name):
        options.setdefault("special_tokens", dict(run.tokenizer.special_tokens))
    objective = objectives.build(run.objective.name, tokenizer, **options)
    objective.check_architecture(run.model.arch)
    check_tokenizer(tokenizer, run.model.vocab_size, objective.required_tokens, run.tokenizer.special_tokens)
    return objective


def build_data(run: RunConfig, objective: Any, tokenizer: Any) -> Any:
    """The datamodule; ``ValueError`` when a prepared corpus was tokenized with another tokenizer."""
    from datamodules.prepare import read_meta
    from pretrain.module import PretrainData

    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    for source in run.data.sources:
        if read_meta(source.prepared).get("tokenizer_sha256") != digest:
            raise ValueError(
                f"{source.prepared} was prepared with another tokenizer than {run.tokenizer.path}; "
                f"rerun `pretrain prepare` (with --force) or point data.sources at matching data"
            )
    return PretrainData(
        [s.prepared for s in run.data.sources],
        objective,
        seq_len=run.data.seq_len,
        micro_batch_size=run.data.micro_batch_size,
        weights=[s.weight for s in run.data.sources],
        num_workers=run.data.num_workers,
        seed=run.seed,
        val_batches=run.trainer.limit_val_batches,
        accumulate_grad_batches=run.trainer.accumulate_grad_batches,
    )


def resume_path(run: RunConfig) -> Path | None:
    """``resume``: None (fresh), ``auto`` (newest valid checkpoint of the run, if any) or a checkpoint path."""
    from pretrain.checkpoint import find_resume

    if run.resume is None:
        return None
    if run.resume == "auto":
        return find_resume(run.checkpoint_dir)
    path = Path(run.resume)
    if not path.exists():
        raise FileNotFoundError(f"resume={run.resume}: no such checkpoint (use resume=auto or resume=null)")
    return path


def new_run_id() -> str:
    """A fresh W&B run id (8 lowercase letters / digits, as wandb makes them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def prepare_run(run: RunConfig, resolved: dict[str, Any]) -> dict[str, Any]:
    """Everything before the Trainer: tokenizer, objective, data, checkpoint to resume, module. Cheap, and it
    raises on bad input (missing files, objective/architecture, tokenizer/vocab, foreign checkpoint)."""
    import lightning as L

    from datamodules.tokenizer import load_tokenizer
    from pretrain.checkpoint import check_compatible, payload
    from pretrain.module import PretrainModule

    tokenizer = load_tokenizer(run.tokenizer.path)
    objective = build_objective(run, tokenizer)
    datamodule = build_data(run, objective, tokenizer)
    ckpt = resume_path(run)
    wandb_id = None
    if ckpt is not None:
        saved = payload(ckpt)
        check_compatible(saved["config"]["model"], resolved["model"], ckpt)
        wandb_id = saved.get("wandb_run_id")
    L.seed_everything(run.seed, verbose=False)
    module = PretrainModule(
        run,
        objective,
        resolved=resolved,
        tokenizer_json=tokenizer.to_str(),
        wandb_id=wandb_id or new_run_id(),
    )
    return {"tokenizer": tokenizer, "datamodule": datamodule, "module": module, "ckpt": ckpt}


# ---------------------------------------------------------------------------------------------- commands


def cmd_fit(args: argparse.Namespace) -> int:
    from pretrain.model import Block
    from pretrain.trainer import build_trainer

    run, resolved = configs.load(args.recipe, args.overrides)
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(resolved), end="")
        return 0
    parts = prepare_run(run, resolved)
    module = parts["module"]
    trainer = build_trainer(run, resolved, block_classes={Block}, wandb_id=module.wandb_id)
    trainer.fit(module, datamodule=parts["datamodule"], ckpt_path=parts["ckpt"], weights_only=True)
    last = run.checkpoint_dir / "last.ckpt"
    trainer.save_checkpoint(last, weights_only=False)  # the final state, whatever the checkpoint interval
    if trainer.is_global_zero:
        _summary(trainer, run, module, last)
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
            lines.append(f"metrics CSV: {Path(logger.log_dir) / 'metrics.csv'}")
    print("\n== pretrain fit: done ==\n" + "\n".join(f"  {line}" for line in lines))


def cmd_validate(args: argparse.Namespace) -> int:
    from pretrain.model import Block
    from pretrain.trainer import build_trainer

    overrides = list(args.overrides) + ([f"resume={args.ckpt}"] if args.ckpt else [])
    run, resolved = configs.load(args.recipe, overrides)
    parts = prepare_run(run, resolved)
    if parts["ckpt"] is None:
        raise FileNotFoundError(f"no checkpoint in {run.checkpoint_dir}; pass --ckpt PATH or train first")
    trainer = build_trainer(run, resolved, block_classes={Block}, loggers=[])
    results = trainer.validate(
        parts["module"],
        datamodule=parts["datamodule"],
        ckpt_path=parts["ckpt"],
        weights_only=True,
        verbose=False,
    )
    if trainer.is_global_zero:
        print(f"checkpoint: {parts['ckpt']}")
        for name, value in sorted(results[0].items()):
            print(f"  {name}: {value:.4f}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pretrain.checkpoint import load_model
    from pretrain.generation import generate

    model, _, tokenizer = load_model(args.checkpoint)
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer; cannot encode a text prompt")
    cfg = model.config
    ids = torch.tensor([tokenizer.encode(args.prompt).ids] * args.num_samples, dtype=torch.long)
    if ids.shape[1] == 0 and cfg.arch == "decoder":
        raise ValueError("the prompt is empty; pass --prompt TEXT")
    eos = tokenizer.token_to_id(args.eos) if args.eos else None
    generator = torch.Generator().manual_seed(args.seed)
    enc_dec = cfg.arch == "encoder-decoder"
    out = generate(
        model.eval(),
        None if enc_dec else ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        eos_token_id=eos,
        generator=generator,
        encoder_input_ids=ids if enc_dec else None,
    )
    for i, row in enumerate(out.tolist()):
        text = tokenizer.decode(row if enc_dec else row[ids.shape[1] :], skip_special_tokens=not enc_dec)
        print(f"--- sample {i} ---\n{'' if enc_dec else args.prompt}{text}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import tempfile

    from pretrain.checkpoint import load_model
    from pretrain.hf import save_hf

    model, _, tokenizer = load_model(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = None
        if tokenizer is not None:
            tokenizer_path = Path(tmp) / "tokenizer.json"
            tokenizer.save(str(tokenizer_path))
        out = save_hf(model, args.out_dir, tokenizer_path)
    print(f"exported {args.checkpoint} -> {out} (transformers from_pretrained format)")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from datamodules.tokenizer import train_bpe

    run, _ = configs.load(args.recipe, args.overrides)
    t = run.tokenizer
    path = Path(t.path)
    if path.exists() and not args.force:
        print(f"tokenizer {path} exists; reusing it (--force retrains)")
        return 0
    if not t.train_files:
        raise ValueError(
            f"tokenizer {path} does not exist and tokenizer.train_files is empty; list training text"
        )
    tokenizer = train_bpe(list(t.train_files), t.vocab_size, path, min_frequency=t.min_frequency)
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens -> {path}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from datamodules.prepare import prepare

    run, _ = configs.load(args.recipe, args.overrides)
    for source in run.data.sources:
        if not source.text:
            raise ValueError(f"data source {source.name!r} lists no raw text (data.sources[].text)")
        meta = prepare(
            list(source.text),
            run.tokenizer.path,
            source.prepared,
            val_fraction=run.data.val_fraction,
            eos_token=run.tokenizer.special_tokens.get("eos"),
            force=args.force,
        )
        counts = ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['documents']:,} documents" for k, v in meta["splits"].items()
        )
        print(f"prepared {source.name} -> {source.prepared}: {counts}")
    return 0


# ---------------------------------------------------------------------------------------------- parser

COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "fit": (cmd_fit, "train a recipe (resumes from the newest valid checkpoint with resume=auto)"),
    "validate": (cmd_validate, "validation metrics of a checkpoint"),
    "generate": (cmd_generate, "sample text from a checkpoint (greedy, temperature, top-k, top-p)"),
    "export": (cmd_export, "write a checkpoint as a Hugging Face model directory"),
    "tokenizer": (cmd_tokenizer, "train the recipe's byte-level BPE tokenizer (reuse it if present)"),
    "prepare": (cmd_prepare, "tokenize the recipe's raw text into train/val token shards"),
}

# Stages that live in their own modules: name -> (module, handler, help). Each module has ``add_arguments``.
EXTERNAL_COMMANDS: dict[str, tuple[str, str, str]] = {
    "finetune": (
        "pretrain.finetune",
        "cmd_finetune",
        "finetune a pretrained or Hugging Face backbone on a downstream task (heads, T5 text-to-text)",
    ),
    "evaluate": ("pretrain.evaluation.cli", "run", "few-shot in-context and perplexity evaluation of a checkpoint"),
    "baseline": (
        "pretrain.baselines",
        "cmd_baseline",
        "train and evaluate a classic baseline recipe (SGNS, GloVe, LSTM LM, seq2seq with attention)",
    ),
}


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. trainer.max_steps=100")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; a later stage's module is imported (and its arguments added) only for ``command``."""
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {
        name: sub.add_parser(name, help=text, description=text) for name, (_, text) in COMMANDS.items()
    }
    for name in ("fit", "validate", "tokenizer", "prepare"):
        _recipe_args(parsers[name])
    parsers["fit"].add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parsers["validate"].add_argument("--ckpt", help="checkpoint (default: the newest valid one of the run)")
    parsers["tokenizer"].add_argument("--force", action="store_true", help="retrain even if the file exists")
    parsers["prepare"].add_argument("--force", action="store_true", help="overwrite prepared data")
    g = parsers["generate"]
    g.add_argument("checkpoint", help="a .ckpt written by `pretrain fit` (or a sharded checkpoint directory)")
    g.add_argument("--prompt", default="\n", help="prompt text (encoder input for encoder-decoder models)")
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eos", default="</s>", help="stop token ('' to never stop early)")
    e = parsers["export"]
    e.add_argument("checkpoint", help="a .ckpt (or a sharded FSDP/DeepSpeed checkpoint directory)")
    e.add_argument("out_dir", help="output directory (config.json, model.safetensors, tokenizer)")
    for name, (module, handler, text) in EXTERNAL_COMMANDS.items():
        stage_parser = sub.add_parser(name, help=text, description=text)
        if name == command:
            stage = importlib.import_module(module)
            stage.add_arguments(stage_parser)
            stage_parser.set_defaults(stage_handler=getattr(stage, handler))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), None))
    args, extra = parser.parse_known_args(argv)  # key=value overrides may also follow --flags
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        handler = getattr(args, "stage_handler", None) or COMMANDS[args.command][0]
        return handler(args)
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("PRETRAIN_TRACEBACK"):
            raise
        print(f"pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
