"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on our backbone through the
``peft`` library: every targeted ``nn.Linear`` ``W`` of the transformer blocks becomes ``W x + (alpha / r) B A x``
with ``A`` (r, d_in) Gaussian-initialised, ``B`` (d_out, r) zero; ``W`` and every other backbone parameter are
frozen (a task head stays trainable). ``merge`` folds ``B A`` into ``W`` (``peft``'s ``merge_and_unload``), giving
a plain ``Transformer`` that exports like a pretrained one."""

from __future__ import annotations

from typing import Any

from torch import nn

from pretrain.errors import InputError
from pretrain.finetuning.config import LoRAConfig
from pretrain.models.config import BLOCK_LINEARS
from pretrain.models.transformer import Transformer

ADAPTER = "default"


def _peft_config(cfg: LoRAConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft annotates an int; it scales by alpha / r
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
    )


def add_lora(backbone: Transformer, cfg: LoRAConfig) -> Any:
    """Inject LoRA into ``backbone`` in place (its blocks' linears named in ``cfg.target_modules``), freezing
    the rest of it; returns ``peft``'s ``LoraModel`` over it (for ``merge``). InputError naming the block linears
    (``BLOCK_LINEARS``) when a target is none of them; one the backbone lacks (``gate`` without a GLU MLP) adapts
    nothing."""
    try:
        from peft.tuners.lora import LoraModel
    except ImportError as err:
        raise InputError("finetune.lora needs the peft package: pip install 'pretrain[lora]'") from err
    unknown = sorted(set(cfg.target_modules) - set(BLOCK_LINEARS))
    if unknown:
        raise InputError(
            f"lora.target_modules {unknown} name no linear layer of the backbone's blocks; "
            f"choose from {list(BLOCK_LINEARS)}"
        )
    # targets are block linears only: e.g. "out" would otherwise also match a task head's output layer
    return LoraModel(backbone, _peft_config(cfg), ADAPTER)


def merge(lora: Any) -> Transformer:
    """The backbone with ``W + (alpha / r) B A`` in place of each LoRA layer (same function, plain layout)."""
    return lora.merge_and_unload()


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters of ``model`` (shared tensors once; a ZeRO-3 partitioned parameter by
    its full size ``ds_numel``, as its local tensor is empty)."""
    params = {id(p): p for p in model.parameters()}.values()
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in params]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)


def trainable_summary(model: nn.Module) -> str:
    """``trainable parameters: N of M (p %)``."""
    trainable, total = parameter_counts(model)
    return f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f} %)"
