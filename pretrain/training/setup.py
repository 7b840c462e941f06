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
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig
from pretrain.config.run import check_checkpoint


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
        raise ValueError(
            f"checkpoint.monitor={run.checkpoint.monitor!r} is not a metric the validation logs ({logged})"
            + (f"; did you mean {close[0]!r}?" if close else "; pick one of them")
            + " (or checkpoint.save_top_k=0 to keep only last.ckpt)"
        )
    check_checkpoint(run.checkpoint)


def build_data(run: RunConfig, objective: Any, tokenizer: Any) -> Any:
    """The datamodule; ``ValueError`` when a prepared corpus was tokenized with another tokenizer."""
    from pretrain.config.run import mixture_schedule
    from pretrain.datamodules.prepare import read_meta
    from pretrain.training.module import PretrainData

    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    for source in run.data.sources:
        if read_meta(source.prepared).get("tokenizer_sha256") != digest:
            raise ValueError(
                f"{source.prepared} was prepared with another tokenizer than {run.tokenizer.path}; "
                f"rerun `pretrain prepare` (with --force) or point data.sources at matching data"
            )
        if source.text:
            check_fresh(run, source, tokenizer)
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
            raise ValueError(
                f"model.{name}={getattr(run.model, name)} but the tokenizer {run.tokenizer.path} gives {value}; "
                f"remove model.{name} (special-token ids come from the tokenizer)"
            )
    return ids


def check_fresh(run: RunConfig, source: Any, tokenizer: Any) -> None:
    """``ValueError`` when ``source.prepared`` is not what ``pretrain prepare`` would write from the recipe now
    (raw text edited, settings changed, files damaged): training on it would silently use stale data."""
    from pretrain.datamodules.prepare import stale_reason

    reason = stale_reason(
        source.prepared,
        list(source.text),
        tokenizer,
        val_fraction=run.data.val_fraction,
        document=source.document,
        text_field=source.text_field,
        on_invalid_utf8=run.data.on_invalid_utf8,
        eos_token=run.tokenizer.special_tokens.get("eos"),
        dedup=source.dedup,
    )
    if reason is not None:
        raise ValueError(
            f"data source {source.name!r}: {source.prepared} is stale ({reason}); rerun `pretrain prepare` "
            "with this recipe to rebuild it"
        )


def _as_last(done: Path, last: Path) -> Path:
    """``done`` (a finished run's newest state, e.g. the best-k checkpoint of its final validation, saved just
    before a kill cut the final ``last.ckpt``) copied to ``last`` atomically: no step is left to save it."""
    import shutil

    from pretrain.datamodules.storage import replace_path

    tmp = last.with_name(f".{last.name}.{secrets.token_hex(4)}.tmp")  # what remove_partial_saves cleans up
    (shutil.copytree if done.is_dir() else shutil.copy2)(done, tmp)
    replace_path(tmp, last)
    return last


def resume_path(run: RunConfig) -> Path | None:
    """``resume``: None (fresh), ``auto`` (the run's valid checkpoint of the highest step, Lightning's HPC
    checkpoints in ``run_dir`` included, if any) or a checkpoint path."""
    from pretrain.training.checkpoint.resume import checkpoint_step, find_resume

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
    path = Path(run.resume)
    if not path.exists():
        raise FileNotFoundError(f"resume={run.resume}: no such checkpoint (use resume=auto or resume=null)")
    return path


def corpus_key(meta: dict[str, Any]) -> str:
    """What a prepared corpus was made of, tokenizer aside: its inputs' content hashes and the prepare settings."""
    material = {"inputs": [i.get("sha256") for i in meta.get("inputs", [])], "settings": meta.get("settings")}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


RESUME_CHANGES = {
    "tokenizer": "the checkpoint's weights now read another tokenizer's ids; checkpoints from here on store the new "
    "tokenizer",
    "data": "weights, optimizer and step continue; the sample order continues from the checkpoint's position over "
    "the new corpus",
}


def check_same_inputs(
    run: RunConfig, saved: dict[str, Any], tokenizer_json: str, data_keys: dict[str, Any], ckpt: Path
) -> None:
    """A resume continues on the tokenizer and prepared corpora the checkpoint trained on (``tokenizer.json`` text,
    each source's ``meta.json`` cache key), unless ``resume_allow`` lists the change; then a warning says what
    happens. Checkpoints from before these were recorded are not checked."""
    import warnings

    changed = []
    if saved.get("tokenizer_json") is not None and saved["tokenizer_json"] != tokenizer_json:
        changed.append(("tokenizer", f"the tokenizer differs from the checkpoint's ({run.tokenizer.path})"))
    if saved.get("data_keys") is not None and saved["data_keys"] != data_keys:
        changed.append(("data", f"the prepared data differs from the checkpoint's ({sorted(data_keys)})"))
    for what, problem in changed:
        if what not in run.resume_allow:
            raise ValueError(
                f"cannot resume {ckpt}: {problem}; resume with the tokenizer and data it trained on, start a new run "
                f"(name=NEW or resume=null), or pass resume_allow=[{what}] ({RESUME_CHANGES[what]})"
            )
        warnings.warn(
            f"resuming {ckpt} although {problem} (resume_allow): {RESUME_CHANGES[what]}", stacklevel=2
        )


def new_run_id() -> str:
    """A fresh W&B run id (8 lowercase letters / digits, as wandb makes them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def prepare_run(run: RunConfig, resolved: dict[str, Any]) -> dict[str, Any]:
    """Everything before the Trainer: tokenizer, objective, data, checkpoint to resume, module. Cheap, and it
    raises on bad input (missing files, objective/architecture, tokenizer/vocab, foreign checkpoint)."""
    import lightning as L

    from pretrain.datamodules.prepare import read_meta
    from pretrain.datamodules.tokenizer import load_tokenizer
    from pretrain.training.checkpoint.io import payload
    from pretrain.training.checkpoint.resume import check_compatible
    from pretrain.training.module import PretrainModule

    tokenizer = load_tokenizer(run.tokenizer.path)
    ids = model_token_ids(run, tokenizer)
    run.model = dataclasses.replace(run.model, **ids)
    resolved["model"] = {**resolved["model"], **ids}
    objective = build_objective(run, tokenizer)
    datamodule = build_data(run, objective, tokenizer)
    ckpt = resume_path(run)
    wandb_id = None
    data_keys = {s.name: corpus_key(read_meta(s.prepared)) for s in run.data.sources}
    if ckpt is not None:
        saved = payload(ckpt)
        check_compatible(saved["config"]["model"], resolved["model"], ckpt)
        check_same_inputs(run, saved, tokenizer.to_str(), data_keys, ckpt)
        wandb_id = saved.get("wandb_run_id")
    L.seed_everything(run.seed, verbose=False)
    module = PretrainModule(
        run,
        objective,
        resolved=resolved,
        tokenizer_json=tokenizer.to_str(),
        wandb_id=wandb_id or new_run_id(),
        data_keys=data_keys,
    )
    return {"tokenizer": tokenizer, "datamodule": datamodule, "module": module, "ckpt": ckpt}
