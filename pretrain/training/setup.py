"""Everything a pretraining run builds before the Trainer: objective, datamodule, checkpoint to resume, module.

Cheap, and it raises ``ValueError`` / ``FileNotFoundError`` on bad input (missing files, objective/architecture,
tokenizer/vocab, foreign checkpoint) before any heavy work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.checkpoint.resume import (
    MISSING,
    Compared,
    at,
    compare_for_resume,
    config_keys,
    file_keys,
    lr_schedule_values,
    optimizer_values,
)
from pretrain.config import RunConfig
from pretrain.config.run import TrainingRun, check_checkpoint, check_resume_path
from pretrain.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pretrain.training.module import PretrainData, PretrainModule


def build_objective(run: RunConfig, tokenizer: Any) -> Any:
    """The configured objective, checked against the architecture and the tokenizer."""
    from pretrain import objectives
    from pretrain.datamodules.tokenizer import check_tokenizer

    options = dict(run.objective.options)
    if run.tokenizer.special_tokens and "special_tokens" in objectives.options(run.objective.name):
        options.setdefault("special_tokens", dict(run.tokenizer.special_tokens))
    objective = objectives.OBJECTIVES[run.objective.name](tokenizer, **options)  # options checked by validate
    objective.check_architecture(run.model.arch)
    check_tokenizer(tokenizer, run.model.vocab_size, objective.required_tokens, run.tokenizer.special_tokens)
    check_monitor(run, objective)
    return objective


def check_monitor(run: RunConfig, objective: Any) -> None:
    """``checkpoint.monitor`` names a metric the validation logs (else the best-k callback fails only at the first
    validation, possibly hours in), and ``checkpoint.mode`` says or its name tells which way is better."""
    import difflib

    import torch

    if run.checkpoint.save_top_k == 0:
        return
    one = torch.tensor(1.0)
    logged = sorted(
        f"val/{k}" for k in objective.summarize({"loss_sum": one, "num_targets": one, "num_correct": one})
    )
    if run.checkpoint.monitor not in logged:
        close = difflib.get_close_matches(run.checkpoint.monitor, logged, n=1, cutoff=0.5)
        raise InputError(
            f"checkpoint.monitor={run.checkpoint.monitor!r} is not a metric the validation logs ({logged})"
            + (f"; did you mean {close[0]!r}?" if close else "; pick one of them")
            + " (or checkpoint.save_top_k=0 to keep only last.ckpt)"
        )
    check_checkpoint(run.checkpoint)


def build_data(run: RunConfig, objective: Any, tokenizer: Any) -> Any:
    """The datamodule; ``ValueError`` when a prepared corpus was tokenized with another tokenizer."""
    from pretrain.config.run import mixture_schedule
    from pretrain.datamodules.prepare import FORMAT_VERSION, format_change, read_meta
    from pretrain.training.module import PretrainData

    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    for source in run.data.sources:
        meta = read_meta(source.prepared)
        if meta.get("tokenizer_sha256") != digest:
            raise InputError(
                f"{source.prepared} was prepared with another tokenizer than {run.tokenizer.path}; "
                f"rerun `pretrain prepare` (with --force) or point data.sources at matching data"
            )
        if source.text:
            check_fresh(run, source, tokenizer)
        elif meta.get("format_version") != FORMAT_VERSION:  # no text to compare: the format alone tells
            raise InputError(
                f"data source {source.name!r}: {source.prepared} is stale ({format_change(meta.get('format_version'))}); "
                "rerun `pretrain prepare` on its text to rebuild it"
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
        schedule=mixture_schedule(run.data),
        names=[s.name for s in run.data.sources],
        document_mask=run.data.document_mask,
    )


def model_token_ids(run: RunConfig, tokenizer: Any) -> dict[str, int | None]:
    """``ModelConfig``'s special-token ids, from the tokenizer (roles of ``pretrain.datamodules.special_tokens`` with the
    recipe's ``tokenizer.special_tokens``): pad, eos, and for encoder-decoders the first decoder input (T5: pad).
    ``ValueError`` when the model config sets one that disagrees (they are the tokenizer's, not the model's)."""
    from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS

    table = {**DEFAULT_SPECIAL_TOKENS, **run.tokenizer.special_tokens}
    pad, eos = (tokenizer.token_to_id(table[role]) for role in ("pad", "eos"))
    ids = {"pad_token_id": pad, "eos_token_id": eos}
    ids["decoder_start_token_id"] = pad if run.model.arch == "encoder-decoder" else None
    for name, value in ids.items():
        if getattr(run.model, name) not in (None, value):
            raise InputError(
                f"model.{name}={getattr(run.model, name)} but the tokenizer {run.tokenizer.path} gives {value}; "
                f"remove model.{name} (special-token ids come from the tokenizer)"
            )
    return ids


def check_fresh(run: RunConfig, source: Any, tokenizer: Any) -> None:
    """``ValueError`` when ``source.prepared`` is not what ``pretrain prepare`` would write from the recipe now
    (raw text edited, settings changed, files damaged): training on it would silently use stale data."""
    from pretrain.config.run import corpus_settings
    from pretrain.datamodules.prepare import stale_reason

    reason = stale_reason(source.prepared, list(source.text), tokenizer, **corpus_settings(run, source))
    if reason is not None:
        raise InputError(
            f"data source {source.name!r}: {source.prepared} is stale ({reason}); rerun `pretrain prepare` "
            "with this recipe to rebuild it"
        )


def _as_last(done: Path, last: Path) -> Path:
    """``done`` (a finished run's newest state, e.g. the best-k checkpoint of its final validation, saved just
    before a kill cut the final ``last.ckpt``) copied to ``last`` atomically: no step is left to save it."""
    import shutil

    from pretrain.io import replace_path

    tmp = last.with_name(f".{last.name}.{secrets.token_hex(4)}.tmp")  # what remove_partial_saves cleans up
    (shutil.copytree if done.is_dir() else shutil.copy2)(done, tmp)
    replace_path(tmp, last)
    return last


# a run's outputs at its end (curves; a finetune's results and merged model), set aside with its checkpoints
EARLIER_OUTPUTS = ("curves.png", "results.json", "finetuned.pt")


def set_aside_checkpoints(run: TrainingRun) -> Path | None:
    """``resume=null`` in a run directory that holds checkpoints (an earlier run under this name): move them into
    ``checkpoints/replaced-<time>/``, where ``resume=auto`` does not look. Left in place, the earlier run's
    checkpoint of a higher step was later resumed as this run's (and copied over its ``last.ckpt``). Nothing is
    deleted; the other ranks of a launch leave it to the first. The directory moved to, or None."""
    import os
    import time
    import warnings

    from pretrain.io import RANK_VARIABLES

    directory = Path(run.checkpoint_dir)
    earlier = sorted(directory.glob("[!.]*.ckpt")) if directory.is_dir() else []
    earlier += sorted(Path(run.run_path).glob("hpc_ckpt_*.ckpt")) if Path(run.run_path).is_dir() else []
    if not earlier or any(os.environ.get(name, "0") not in ("", "0") for name in RANK_VARIABLES):
        return None
    aside = directory / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    while aside.exists():
        aside = aside.with_name(f"{aside.name}-{secrets.token_hex(2)}")
    aside.mkdir(parents=True)
    for path in earlier:
        os.replace(path, aside / path.name)
    logs = Path(run.run_path) / "logs"
    versions = sorted(logs.glob("version_*")) if logs.is_dir() else []
    if versions:  # its CSV logs too: curves.png and `pretrain plot` read every version as this run's
        (logs / aside.name).mkdir()
        for path in versions:
            os.replace(path, logs / aside.name / path.name)
    # and what it wrote at its end, which a fresh run ended early (killed) would otherwise leave as its own
    outputs = [Path(run.run_path) / name for name in EARLIER_OUTPUTS if (Path(run.run_path) / name).is_file()]
    for path in outputs:
        os.replace(path, aside / path.name)
    warnings.warn(
        f"resume=null: the {len(earlier)} checkpoint(s) of an earlier run in {run.run_path} moved to {aside}"
        + (f" with its {', '.join(p.name for p in outputs)}" if outputs else "")
        + (f" and its CSV logs to {logs / aside.name}" if versions else "")
        + " (resume=auto would have taken them for this run's); delete them once you do not need them",
        stacklevel=2,
    )
    return aside


def continued_wandb_id(ckpt: Path, saved: dict[str, Any], run_path: Path) -> str | None:
    """The W&B run a resume from ``ckpt`` (payload ``saved``) continues: the checkpoint's, when it lies in the run's
    own directory; None (a run of its own) for another run directory's checkpoint (``resume=PATH``: a branch,
    not that run's continuation, whose W&B run would get this run's steps and drop its own later ones)."""
    import warnings

    wandb_id = saved.get("wandb_run_id")
    if wandb_id and not _within(ckpt, run_path):
        warnings.warn(
            f"resume={ckpt} is a checkpoint of another run directory: its weights, optimizer, step and data "
            f"position continue in {run_path}, logged to a W&B run of its own (W&B run {wandb_id} stays that "
            "run's)",
            stacklevel=3,
        )
        return None
    return wandb_id


def _within(path: str | Path, directory: str | Path) -> bool:
    """Whether ``path`` lies in ``directory`` (links and ``..`` resolved)."""
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def resume_path(run: TrainingRun) -> Path | None:
    """``resume``: None (fresh), ``auto`` (the run's valid checkpoint of the highest step, Lightning's HPC
    checkpoints in ``run_dir`` included, if any) or a checkpoint path."""
    from pretrain.checkpoint.resume import checkpoint_step, find_resume

    if run.resume is None:
        return None
    if run.resume == "auto":
        found = find_resume(run.checkpoint_dir, hpc_dir=run.run_dir)
        if (
            found is not None
            and found.name != "last.ckpt"
            and checkpoint_step(found) >= run.trainer.max_steps
        ):
            return _as_last(found, Path(run.checkpoint_dir) / "last.ckpt")
        return found
    check_resume_path(run)
    return Path(run.resume)


def corpus_key(meta: dict[str, Any]) -> str:
    """What a prepared corpus was made of, tokenizer aside: its inputs' content hashes and the prepare settings."""
    material = {"inputs": [i.get("sha256") for i in meta.get("inputs", [])], "settings": meta.get("settings")}
    if meta.get("format_version", 0) >= 3:  # special-token text encoded as text: other ids, another corpus
        material["special_token_text"] = "text"
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer(payload: dict[str, Any]) -> dict[str, Any]:
    text = payload.get("tokenizer_json")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12] if text is not None else MISSING
    return {"tokenizer (sha256 of tokenizer.json)": digest}


def _stream(section: str) -> Any:
    """What maps a data position to samples, besides the corpora: the packed length and the blend weights."""

    def values(payload: dict[str, Any]) -> dict[str, Any]:
        sources = at(payload, f"{section}.data.sources")
        weights = MISSING if sources is MISSING else {s["name"]: s["weight"] for s in sources}
        return {
            "prepared data (corpus keys)": payload.get("data_keys", MISSING) or MISSING,
            "data.sources[].weight": weights,
            "data.seq_len": at(payload, f"{section}.data.seq_len"),
        }

    return values


def _mixture(payload: dict[str, Any]) -> dict[str, Any]:
    """``data.schedule`` (when it has phases), and the samples per optimizer step its stream counts in."""
    schedule = at(payload, "config.data.schedule")
    if schedule is MISSING:
        return {}
    if not schedule["phases"]:
        return {"data.schedule": None, "data.schedule has phases": False}
    return {
        "data.schedule": schedule,
        "data.schedule has phases": True,
        **_samples_per_step(payload, "config"),
    }


def _samples_per_step(payload: dict[str, Any], section: str) -> dict[str, Any]:
    config = at(payload, section)
    if config is MISSING:
        return {}
    t = config["trainer"]
    per_step = config["data"]["micro_batch_size"] * t["accumulate_grad_batches"] * _data_parallel(config)
    return {SAMPLES_PER_STEP: per_step}


def _data_parallel(config: dict[str, Any]) -> int:
    """How many different micro-batches a step of a resolved run config reads at once: its ranks over the tensor-
    and context-parallel ranks that share one (``ParallelDims.dp``)."""
    t, strategy = config["trainer"], config.get("strategy", {})
    shared = strategy.get("tensor_parallel", 1) * strategy.get("context_parallel", 1)
    return t["devices"] * t["num_nodes"] // shared


def stream_position(run: RunConfig, position: tuple[int, int], ckpt: Path) -> int:
    """Where the sample stream of a run resumed with another global batch (``resume_allow=[batch]``) continues,
    said in a warning: the checkpoint's position, moved back to a whole data-parallel batch of this run when it
    is not one (``PretrainData.realign``). Returns how many samples that moves back (read again)."""
    import warnings

    epoch, consumed = position
    from pretrain.parallel.mesh import ParallelDims

    per_batch = run.data.micro_batch_size * ParallelDims.of(run).dp
    per_step = per_batch * run.trainer.accumulate_grad_batches
    back = consumed % per_batch
    again = (
        f" ({back} samples before it, read by the checkpoint's last step, are read again)"
        if back
        else " (every sample before it read once, none skipped)"
    )
    warnings.warn(
        f"resuming {ckpt} with {per_step} samples per step: the sample stream continues at sample "
        f"{consumed - back:,} of epoch {epoch}{again}",
        stacklevel=2,
    )
    return back


SAMPLES_PER_STEP = (
    "samples per step (data.micro_batch_size x trainer.accumulate_grad_batches x data-parallel ranks: "
    "trainer.devices x trainer.num_nodes / (strategy.tensor_parallel x context_parallel))"
)
_SEED = Compared(
    None, "`seed`", config_keys("config", "seed"), "the sample order and dropout follow the seed"
)
FIT_RESUME = (
    _SEED,
    Compared(
        None,
        "`init.checkpoint`: the weights the run started from",
        file_keys("config", "init.checkpoint"),
        "the run's checkpoints would name another starting point than the one its weights descend from",
    ),
    Compared(
        "tokenizer",
        "the tokenizer (`tokenizer.json`)",
        _tokenizer,
        "the checkpoint's weights now read another tokenizer's ids; checkpoints from here on store the new "
        "tokenizer",
    ),
    Compared(
        "data",
        "the prepared corpora (`meta.json` keys), `data.sources[].weight`, `data.seq_len`",
        _stream("config"),
        "weights, optimizer and step continue; the sample order continues from the checkpoint's position over "
        "the new stream, which is recomputed from step 0 (samples may be read again or never; change a mixture "
        "mid-run with data.schedule phases instead)",
    ),
    Compared(
        "objective",
        "`objective.name`, `objective.options`",
        config_keys("config", "objective.name", "objective.options"),
        "weights, optimizer and data position continue under the new objective; losses before and after are not "
        "comparable",
    ),
    Compared(
        "optimizer",
        "`optim.name`, `betas`, `eps`, `weight_decay`, `optim.muon.*` but `lr` and `ns_dtype`",
        optimizer_values("config"),
        "optimizer state re-initialised: moments and step counts start from zero with the new settings; "
        "weights, learning-rate schedule position and data continue",
    ),
    Compared(
        "lr_schedule",
        "`optim.lr`, `schedule`, `warmup_steps`, `min_lr_ratio`, `decay_steps` (default `trainer.max_steps`), "
        "`cooldown_fraction` (wsd), `optim.muon.lr`",
        lr_schedule_values("config"),
        "the learning rate follows the new schedule from the checkpoint's step on",
    ),
    Compared(
        "data_schedule",
        "`data.schedule` (with phases)",
        lambda payload: {k: v for k, v in _mixture(payload).items() if k == "data.schedule"},
        "the samples of the steps before the checkpoint stay those its schedule drew (none is read twice or "
        "skipped); the new schedule sets the mixture from the checkpoint's step on",
    ),
    Compared(
        "batch",
        "samples per optimizer step (`data.micro_batch_size` x `trainer.accumulate_grad_batches` x "
        "`trainer.devices` x `trainer.num_nodes`; the strategy and the number of ranks may change with it kept)",
        lambda payload: _samples_per_step(payload, "config"),
        "weights, optimizer, step and learning-rate schedule continue; the sample stream continues from the "
        "checkpoint's position (the next warning says where)",
    ),
    Compared(
        None,
        "whether `data.schedule` has phases; samples per optimizer step (with phases)",
        lambda payload: {k: v for k, v in _mixture(payload).items() if k != "data.schedule"},
        "a schedule's stream counts its draws per step",
    ),
)

# what `pretrain validate` compares: the meaning of the weights and of the validation stream
VALIDATE_RESUME = (_SEED, *(c for c in FIT_RESUME if c.allow in ("tokenizer", "data", "objective")))


def new_run_id() -> str:
    """A fresh W&B run id (8 lowercase letters / digits, as wandb makes them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


@dataclass
class PreparedRun:
    """What ``prepare_run`` builds: the Trainer's module and datamodule, and the checkpoint it resumes from."""

    tokenizer: Tokenizer
    datamodule: PretrainData
    module: PretrainModule
    ckpt: Path | None  # the checkpoint to resume (``resume``), None for a fresh run


def prepare_run(run: RunConfig, resolved: dict[str, Any], *, training: bool = True) -> PreparedRun:
    """Everything before the Trainer: tokenizer, objective, data, checkpoint to resume, module. Cheap, and it
    raises on bad input (missing files, objective/architecture, tokenizer/vocab, foreign checkpoint). Not
    ``training`` (``pretrain validate``): only what gives the weights and the validation data their meaning is
    compared (``VALIDATE_RESUME``), not the optimizer, the schedules or the batch."""

    import lightning as L

    from pretrain.checkpoint.convert import initial_weights, refuse_finetuned
    from pretrain.checkpoint.io import data_position, payload
    from pretrain.checkpoint.resume import check_compatible, check_trainable
    from pretrain.datamodules.prepare import read_meta
    from pretrain.datamodules.tokenizer import load_tokenizer
    from pretrain.io import exchanges_atomically
    from pretrain.training.module import PretrainModule

    if training and run.checkpoint.async_save and not exchanges_atomically(run.checkpoint_dir):
        raise InputError(
            f"checkpoint.async_save=true needs a file system that swaps two names atomically (renameat2 "
            f"RENAME_EXCHANGE), so that last.ckpt always names a complete checkpoint; {run.checkpoint_dir}'s "
            "cannot: put run_dir on a local Linux file system, or set checkpoint.async_save=false"
        )
    tokenizer = load_tokenizer(run.tokenizer.path)
    ids: dict[str, Any] = model_token_ids(run, tokenizer)  # ModelConfig's special-token id fields
    run.model = dataclasses.replace(run.model, **ids)
    resolved["model"] = {**resolved["model"], **ids}
    objective = build_objective(run, tokenizer)
    datamodule = build_data(run, objective, tokenizer)
    ckpt = resume_path(run)
    if training and run.resume is None:
        set_aside_checkpoints(run)
    wandb_id, changes = None, []
    data_keys = {s.name: corpus_key(read_meta(s.prepared)) for s in run.data.sources}
    if ckpt is not None:
        if training:
            check_trainable(ckpt)
        saved = payload(ckpt)
        refuse_finetuned(ckpt, saved)
        check_compatible(saved["config"]["model"], resolved["model"], ckpt)
        current = {"config": resolved, "tokenizer_json": tokenizer.to_str(), "data_keys": data_keys}
        table = FIT_RESUME if training else VALIDATE_RESUME
        changes = compare_for_resume(table, saved, current, run.resume_allow, ckpt)
        if "batch" in changes:
            datamodule.realign = stream_position(run, data_position(ckpt), ckpt) > 0
        wandb_id = continued_wandb_id(ckpt, saved, run.run_path) if training else None
    L.seed_everything(run.seed, verbose=False)
    module = PretrainModule(
        run,
        objective,
        resolved=resolved,
        tokenizer_json=tokenizer.to_str(),
        wandb_id=wandb_id or new_run_id(),
        data_keys=data_keys,
    )
    module.resume_changes = frozenset(changes)
    if ckpt is None and run.init.checkpoint is not None:  # a fresh run from another run's weights
        module.model.load_state_dict(initial_weights(run.init.checkpoint, module.model, tokenizer.to_str()))
    return PreparedRun(tokenizer=tokenizer, datamodule=datamodule, module=module, ckpt=ckpt)
