"""The backbone to finetune: our pretraining checkpoints (``.ckpt`` with the tokenizer inside), Hugging Face
directories (``config.json`` + ``model.safetensors`` + tokenizer files, through ``pretrain.models.hf.from_hf``) or
random weights (``init.model`` + ``init.tokenizer``; the control in transfer experiments), and freezing."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from torch import nn

from pretrain.errors import InputError
from pretrain.finetuning.config import InitConfig, check_init_checkpoint
from pretrain.models.transformer import Transformer


def _hf_roles(directory: Path) -> dict[str, str]:
    """Special-token roles from a Hugging Face ``special_tokens_map.json`` (e.g. cls -> "[CLS]")."""
    path = directory / "special_tokens_map.json"
    if not path.is_file():
        return {}
    roles = {}
    for key, value in json.loads(path.read_text()).items():
        token = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(token, str):
            roles[key.removesuffix("_token")] = token
    return roles


def _load_hf(directory: Path) -> Transformer:
    import transformers

    from pretrain.models.hf import check_export, from_hf

    check_export(directory)  # a half-written export is named as one, not half-read
    config = transformers.AutoConfig.from_pretrained(directory)
    arch = (getattr(config, "architectures", None) or [""])[0]
    classes = {
        "bert": "BertForMaskedLM" if arch in ("BertForMaskedLM", "BertForPreTraining") else "BertModel",
        "gpt2": "GPT2LMHeadModel",
        "t5": "T5ForConditionalGeneration",
        "llama": "LlamaForCausalLM",
    }
    if config.model_type not in classes:
        raise InputError(
            f"{directory}: model_type {config.model_type!r} is not supported; supported: {sorted(classes)}"
        )
    cls = getattr(transformers, classes[config.model_type])
    try:  # safetensors only: loading never unpickles
        hf_model = cls.from_pretrained(directory, use_safetensors=True)
    except OSError as err:
        raise InputError(f"{directory}: no loadable model.safetensors ({err})") from err
    return from_hf(hf_model)


def load_backbone(init: InitConfig) -> tuple[Transformer, Tokenizer, dict[str, str]]:
    """``(backbone, tokenizer, special-token roles)`` from a pretraining checkpoint, a Hugging Face directory, or
    random weights. ValueError when no tokenizer can be found or it does not fit the model's vocabulary."""
    from pretrain.datamodules.tokenizer import load_tokenizer

    roles: dict[str, str] = {}
    tokenizer = None
    if init.checkpoint is None:
        assert (
            init.model is not None
        )  # load_config requires init.model and init.tokenizer without a checkpoint
        model = Transformer(init.model)
        where = "init.model"
    else:
        path = Path(init.checkpoint).expanduser()
        where = str(path)
        if path.is_dir() and (path / "config.json").is_file():
            model = _load_hf(path)
            roles = _hf_roles(path)
            if init.tokenizer is None:
                try:
                    tokenizer = load_tokenizer(path)
                except FileNotFoundError:
                    raise InputError(
                        f"{path} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); "
                        "pass init.tokenizer=PATH"
                    ) from None
        elif path.exists():
            from pretrain.checkpoint.convert import load_model

            model, info, tokenizer = load_model(path)
            roles = dict(info.get("config", {}).get("tokenizer", {}).get("special_tokens") or {})
            if tokenizer is None and init.tokenizer is None:
                raise InputError(f"checkpoint {path} holds no tokenizer; pass init.tokenizer=PATH")
        else:
            check_init_checkpoint(init)
    if init.tokenizer is not None:
        tokenizer = load_tokenizer(init.tokenizer)
    assert tokenizer is not None  # the backbone's or init.tokenizer (checked above and by load_config)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model.config.vocab_size:
        raise InputError(
            f"the tokenizer has {size} tokens but the backbone from {where} has vocab_size "
            f"{model.config.vocab_size}; use the tokenizer the backbone was trained with"
        )
    return model.train(), tokenizer, roles


def freeze(model: Transformer, embeddings: bool, layers: int) -> None:
    """Stop gradients to the embeddings and/or the lowest ``layers`` blocks of every stack."""
    stacks = [s for s in (model.encoder, model.decoder) if s is not None]
    deepest = min(len(s.blocks) for s in stacks)
    if layers > deepest:
        raise InputError(f"freeze.layers={layers} exceeds the backbone's {deepest} layers per stack")
    modules: list[nn.Module] = [model.embed] if embeddings else []
    modules += [block for s in stacks for block in s.blocks[:layers]]
    for module in modules:
        module.requires_grad_(False)
