"""Float8 training (``trainer.float8``): torchao's ``convert_to_float8_training`` applied to the backbone from
outside, as torchtitan does.

Every ``nn.Linear`` of the transformer blocks whose dimensions are multiples of 16 becomes a ``Float8Linear``:
inputs, weights and output gradients cast to float8 with dynamic tensorwise scales, matmuls on float8 tensor
cores, weights kept in their own dtype. The LM head (tied to the embedding, and the most sensitive matmul) and
the small BERT/T5 heads stay in bf16. Under FSDP2 the weights are all-gathered in float8
(``enable_fsdp_float8_all_gather``), halving the all-gather volume against bf16. torchao is imported only when
float8 is on; ``emulate=True`` computes the same casts with high-precision matmuls (CPU tests).
"""

from __future__ import annotations

from torch import nn

from pretrain.errors import InputError

BLOCK_LINEARS = ("encoder.blocks.", "decoder.blocks.")  # module-name prefixes converted to float8


def float8_eligible(module: nn.Module, name: str) -> bool:
    """A block's ``nn.Linear`` with both dimensions divisible by 16 (float8 GEMM tile constraint)."""
    return (
        isinstance(module, nn.Linear)
        and name.startswith(BLOCK_LINEARS)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_to_float8(model: nn.Module, *, fsdp: bool = False, emulate: bool = False) -> int:
    """Swap the eligible linears of ``model`` for torchao ``Float8Linear`` in place; returns how many."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise InputError("trainer.float8=true needs torchao: pip install 'pretrain[float8]'") from err
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    eligible = sum(float8_eligible(m, name) for name, m in model.named_modules())
    convert_to_float8_training(model, module_filter_fn=float8_eligible, config=config)
    return eligible
