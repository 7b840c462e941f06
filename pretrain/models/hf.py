"""Hugging Face interop: ``from_hf`` / ``to_hf`` / ``save_hf`` for GPT-2, BERT, BigBird, T5, Llama, Mistral and
ModernBERT.

transformers is used only here and only for conversion. Each family is a pair of config translations plus a table
of weight rules ``(our names, HF names, transpose)``: our tensors and the HF tensors hold the same rows, each side
concatenated along dim 0 (GPT-2's fused q|k|v ``c_attn`` is our q, k, v), HF's transposed first for GPT-2's
``Conv1D``. ``to_hf`` checks that the HF config
it builds converts back to the same architecture, so a model HF cannot express raises ``ValueError`` naming the
fields instead of exporting something else. Mistral is Llama plus ``sliding_window`` (our ``attention_window``,
the same 0 <= q - k < w rule); BigBird is supported in its ``original_full`` attention mode only: ``block_sparse``
draws its random blocks from numpy's global RNG inside the forward (and makes the first and last blocks global),
which our seeded pattern does not reproduce. ModernBERT is our pre-norm encoder with a normed embedding, GeGLU and
global attention every k layers: its local layers' ``local_attention`` L (|q - k| <= L / 2) is our
``local_attention_window`` L / 2 + 1 (|q - k| < w), its full / sliding ``rope_theta`` our ``rope_theta`` /
``local_rope_theta``.

transformers 5 notes: T5 always ties ``lm_head`` to ``shared`` in a freshly built model and reads the old
``tie_word_embeddings=False`` as "do not scale decoder outputs" (``scale_decoder_outputs``); an untied T5 (v1.1)
is built by untying after construction and loads untied because both weights are in the checkpoint. Tying is
detected from the parameters themselves, never from the config.

``save_hf_streamed`` (``pretrain export``, ``pretrain convert --to hf``) writes what ``save_hf`` writes, byte for
byte, with one tensor in memory: the transformers model built on the meta device gives the config files and the
saved keys, and the same rules (``_parts``) make each HF tensor from ours when the safetensors writer reaches it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pretrain.errors import InputError
from pretrain.io import STAGING_MARK, permissions_as_umask, staged_directory
from pretrain.models.config import ROPE_SCALINGS, ModelConfig, RopeScaling
from pretrain.models.heads import TaskModel
from pretrain.models.transformer import Attention, Transformer

Rule = tuple[
    tuple[str, ...], tuple[str, ...], bool
]  # (our keys, HF keys: the same rows; transpose each HF one)

# Fields that do not change the function a model computes (ModelConfig.RUN_TIME: backend, dropout, initialisation,
# special-token ids) or have no HF counterpart; not compared by to_hf.
_UNCHECKED = ModelConfig.RUN_TIME | {
    "mup_base_width",  # only read under parametrization=mup, which to_hf folds away (standard_equivalent)
}


def _linear(ours: str | list[str], hf: list[str], bias: bool, transpose: bool = False) -> list[Rule]:
    ours = [ours] if isinstance(ours, str) else ours
    rules = [(tuple(f"{k}.weight" for k in ours), tuple(f"{k}.weight" for k in hf), transpose)]
    if bias:
        rules.append((tuple(f"{k}.bias" for k in ours), tuple(f"{k}.bias" for k in hf), False))
    return rules


def _projections(ours: str, hf: str, pairs: dict[str, str], bias: bool) -> list[Rule]:
    """One rule per linear: ``{our name: HF name}`` under the prefixes ``ours`` and ``hf``."""
    return [r for mine, theirs in pairs.items() for r in _linear(f"{ours}.{mine}", [f"{hf}.{theirs}"], bias)]


def _norm(ours: str, hf: str, bias: bool) -> list[Rule]:
    return _linear(ours, [hf], bias)


def _first(token_id: Any) -> int | None:
    """HF allows lists of eos ids; we keep the first."""
    return token_id[0] if isinstance(token_id, list | tuple) else token_id


def _sizes(c: Any) -> dict[str, Any]:
    """The sizes BERT, BigBird, Llama, Mistral and ModernBERT configs name alike."""
    return {
        "vocab_size": c.vocab_size,
        "d_model": c.hidden_size,
        "n_layer": c.num_hidden_layers,
        "n_head": c.num_attention_heads,
        "d_ff": c.intermediate_size,
        "max_seq_len": c.max_position_embeddings,
    }


def _lookup(table: dict[str, str], key: str, what: str) -> str:
    if key not in table:
        raise InputError(f"{what}={key!r} is not supported; supported: {sorted(table)}")
    return table[key]


# ---------------------------------------------------------------------------------------------------------- GPT-2
_GPT2_ACT = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "relu2": "relu2",
}


def _gpt2_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    if c.add_cross_attention or c.scale_attn_by_inverse_layer_idx:
        raise InputError("GPT-2 with add_cross_attention or scale_attn_by_inverse_layer_idx is not supported")
    return ModelConfig(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        d_ff=c.n_inner or 4 * c.n_embd,
        max_seq_len=c.n_positions,
        norm="layernorm",
        norm_eps=c.layer_norm_epsilon,
        activation=_lookup(_GPT2_ACT, c.activation_function, "GPT2Config.activation_function"),
        position="learned",
        attn_scale="default" if c.scale_attn_weights else "none",
        tie_embeddings=tied,
        dropout=c.resid_pdrop,
        attn_dropout=c.attn_pdrop,
        init="gpt2",
        init_std=c.initializer_range,
        pad_token_id=c.pad_token_id,
        eos_token_id=_first(c.eos_token_id),
    )


def _gpt2_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.d_ff,
        activation_function={"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attn_dropout,
        layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std,
        scale_attn_weights=cfg.attn_scale == "default",
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.eos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    rules = _linear("embed.tok", ["transformer.wte"], False) + _linear(
        "embed.pos", ["transformer.wpe"], False
    )
    for i in range(cfg.n_layer):
        ours, hf = f"decoder.blocks.{i}", f"transformer.h.{i}"
        rules += _norm(f"{ours}.norm1", f"{hf}.ln_1", True) + _norm(f"{ours}.norm2", f"{hf}.ln_2", True)
        rules += _linear([f"{ours}.attn.{n}" for n in "qkv"], [f"{hf}.attn.c_attn"], True, transpose=True)
        rules += _linear(f"{ours}.attn.out", [f"{hf}.attn.c_proj"], True, transpose=True)
        rules += _linear(f"{ours}.mlp.fc", [f"{hf}.mlp.c_fc"], True, transpose=True)
        rules += _linear(f"{ours}.mlp.proj", [f"{hf}.mlp.c_proj"], True, transpose=True)
    return rules + _norm("decoder.norm", "transformer.ln_f", True) + _linear("lm_head", ["lm_head"], False)


# ----------------------------------------------------------------------------------------------------------- BERT
_BERT_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _bert_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    if head and pooler:
        raise InputError(
            "BertForMaskedLM has no pooler: set pooler=False, or lm_head=False to export BertModel"
        )
    return _bert_like_config(c, tied, head, pooler)


def _bert_like_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    if (
        c.is_decoder
        or c.add_cross_attention
        or getattr(c, "position_embedding_type", "absolute") != "absolute"
    ):
        raise InputError("only bidirectional BERT with absolute positions is supported (is_decoder=False)")
    if c.type_vocab_size < 1:
        raise InputError("BERT always adds segment embeddings: type_vocab_size must be >= 1")
    return ModelConfig(
        arch="encoder",
        **_sizes(c),
        norm="layernorm",
        norm_eps=c.layer_norm_eps,
        norm_position="post",
        embedding_norm=True,
        activation=_lookup(_BERT_ACT, c.hidden_act, "BertConfig.hidden_act"),
        position="learned",
        type_vocab_size=c.type_vocab_size,
        tie_embeddings=tied,
        lm_head=head,
        lm_head_bias=head,
        mlm_head_transform=head,
        pooler=pooler,
        dropout=c.hidden_dropout_prob,
        attn_dropout=c.attention_probs_dropout_prob,
        init="bert",
        init_std=c.initializer_range,
        pad_token_id=c.pad_token_id,
    )


def _bert_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """BertConfig / BigBirdConfig arguments the two share."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _bert_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.BertConfig(**_bert_kwargs(cfg))


def _bert_rules(cfg: ModelConfig, pooler: str = "pooler.dense") -> list[Rule]:
    p = "bert." if cfg.lm_head else ""  # BertForMaskedLM nests BertModel under "bert."
    rules = _linear("embed.tok", [f"{p}embeddings.word_embeddings"], False)
    rules += _linear("embed.pos", [f"{p}embeddings.position_embeddings"], False)
    rules += _linear("embed.segment", [f"{p}embeddings.token_type_embeddings"], False)
    rules += _norm("embed.norm", f"{p}embeddings.LayerNorm", True)
    for i in range(cfg.n_layer):
        ours, hf = f"encoder.blocks.{i}", f"{p}encoder.layer.{i}"
        rules += _projections(
            f"{ours}.attn", f"{hf}.attention.self", {"q": "query", "k": "key", "v": "value"}, True
        )
        rules += _linear(f"{ours}.attn.out", [f"{hf}.attention.output.dense"], True)
        rules += _norm(f"{ours}.norm1", f"{hf}.attention.output.LayerNorm", True)
        rules += _linear(f"{ours}.mlp.fc", [f"{hf}.intermediate.dense"], True)
        rules += _linear(f"{ours}.mlp.proj", [f"{hf}.output.dense"], True)
        rules += _norm(f"{ours}.norm2", f"{hf}.output.LayerNorm", True)
    if cfg.pooler:
        rules += _linear("pooler.dense", [f"{p}{pooler}"], True)
    if cfg.lm_head:
        rules += _linear("mlm_transform.dense", ["cls.predictions.transform.dense"], True)
        rules += _norm("mlm_transform.norm", "cls.predictions.transform.LayerNorm", True)
        # transformers 5 ties decoder.bias to cls.predictions.bias only with a tied head; untied, the forward
        # adds decoder.bias and cls.predictions.bias is unused (to_hf sets it equal)
        bias = "cls.predictions.bias" if cfg.tie_embeddings else "cls.predictions.decoder.bias"
        rules += [
            (("lm_head.weight",), ("cls.predictions.decoder.weight",), False),
            (("lm_head.bias",), (bias,), False),
        ]
    return rules


# -------------------------------------------------------------------------------------------------------- BigBird
def _bigbird_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    if c.attention_type != "original_full":
        raise InputError(
            f"BigBirdConfig.attention_type={c.attention_type!r} is not supported: block_sparse draws its random "
            "blocks from numpy's global RNG, which cannot be reproduced; use attention_type='original_full'"
        )
    if c.rescale_embeddings or not c.use_bias:
        raise InputError("BigBird with rescale_embeddings=True or use_bias=False is not supported")
    return dataclasses.replace(
        _bert_like_config(c, tied, head, pooler), attn_dropout=c.attention_probs_dropout_prob
    )


def _bigbird_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.BigBirdConfig(
        **_bert_kwargs(cfg),
        attention_type="original_full",
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
    )


def _bigbird_rules(cfg: ModelConfig) -> list[Rule]:
    return _bert_rules(cfg, pooler="pooler")


# ------------------------------------------------------------------------------------------------------------- T5
_T5_ACT = {  # (is_gated_act, dense_act_fn) -> ours; "gated-gelu" means the tanh approximation ("gelu_new")
    (False, "relu"): "relu",
    (False, "gelu"): "gelu",
    (False, "gelu_new"): "gelu_tanh",
    (True, "gelu_new"): "geglu_tanh",
    (True, "silu"): "swiglu",
    (True, "relu"): "reglu",
}
_T5_FF_PROJ = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "geglu_tanh": "gated-gelu",
    "swiglu": "gated-silu",
    "reglu": "gated-relu",
}


def _t5_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    act = _T5_ACT.get((c.is_gated_act, c.dense_act_fn))
    if act is None:
        raise InputError(f"T5Config.feed_forward_proj={c.feed_forward_proj!r} is not supported")
    start = getattr(c, "decoder_start_token_id", None)
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        n_layer=c.num_layers,
        n_decoder_layer=c.num_decoder_layers,
        n_head=c.num_heads,
        head_dim=c.d_kv,
        d_ff=c.d_ff,
        norm="rmsnorm",
        norm_bias=False,
        norm_eps=c.layer_norm_epsilon,
        activation=act,
        mlp_bias=False,
        attn_bias=False,
        attn_scale="none",
        position="relative",
        relative_num_buckets=c.relative_attention_num_buckets,
        relative_max_distance=c.relative_attention_max_distance,
        tie_embeddings=tied,
        logit_scale=c.d_model**-0.5 if c.scale_decoder_outputs else 1.0,
        dropout=c.dropout_rate,
        init="t5",
        pad_token_id=c.pad_token_id,
        eos_token_id=_first(c.eos_token_id),
        decoder_start_token_id=c.pad_token_id if start is None else start,
    )


def _t5_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.T5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.head_dim,
        d_ff=cfg.d_ff,
        num_layers=cfg.n_layer,
        num_decoder_layers=cfg.n_decoder_layer,
        num_heads=cfg.n_head,
        relative_attention_num_buckets=cfg.relative_num_buckets,
        relative_attention_max_distance=cfg.relative_max_distance,
        dropout_rate=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps,
        feed_forward_proj=_T5_FF_PROJ.get(cfg.activation, "relu"),
        tie_word_embeddings=cfg.logit_scale != 1.0,  # transformers 5: only selects the d_model**-0.5 scaling
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
    )


def _t5_rules(cfg: ModelConfig) -> list[Rule]:
    mlp = {"gate": "wi_0", "fc": "wi_1", "proj": "wo"} if cfg.gated else {"fc": "wi", "proj": "wo"}
    attention = {n: n for n in "qkv"} | {"out": "o"}
    rules = _linear("embed.tok", ["shared"], False)
    for side, n_layer in (("encoder", cfg.n_layer), ("decoder", cfg.n_decoder_layer)):
        rules += _linear(
            f"{side}.relative_bias.embedding",
            [f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias"],
            False,
        )
        for i in range(n_layer or 0):  # an encoder-decoder's: both set
            ours, hf = f"{side}.blocks.{i}", f"{side}.block.{i}.layer"
            attn = f"{hf}.0.SelfAttention"
            rules += _norm(f"{ours}.norm1", f"{hf}.0.layer_norm", False)
            rules += _projections(f"{ours}.attn", attn, attention, False)
            ff = f"{hf}.1"
            if side == "decoder":
                cross, ff = f"{hf}.1.EncDecAttention", f"{hf}.2"
                rules += _norm(f"{ours}.norm_cross", f"{hf}.1.layer_norm", False)
                rules += _projections(f"{ours}.cross_attn", cross, attention, False)
            rules += _norm(f"{ours}.norm2", f"{ff}.layer_norm", False)
            rules += _projections(f"{ours}.mlp", f"{ff}.DenseReluDense", mlp, False)
        rules += _norm(f"{side}.norm", f"{side}.final_layer_norm", False)
    return rules + _linear("lm_head", ["lm_head"], False)


# ---------------------------------------------------------------------------------------------------------- Llama
_LLAMA_ACT = {
    "silu": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "relu": "reglu",
}


def _rope_scaling(rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
    """transformers' ``rope_parameters`` -> our ``RopeScaling`` (None for ``default``); ValueError in one line for a
    type or option we do not compute."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise InputError(f"rope_type={kind!r} is not supported; supported: {['default', *ROPE_SCALINGS]}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise InputError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported (only 1.0)")
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    factor = rope.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek-V3: the ratio of the two lengths
        factor = max_position_embeddings / original
    used = RopeScaling.USES[kind]
    options = {
        "original_max_seq_len": max_position_embeddings if kind == "dynamic" else original,
        "low_freq_factor": rope.get("low_freq_factor"),
        "high_freq_factor": rope.get("high_freq_factor"),
        "beta_fast": rope.get("beta_fast") or 32.0,  # transformers reads a missing or 0 value as the default
        "beta_slow": rope.get("beta_slow") or 1.0,
        "attention_factor": rope.get("attention_factor"),
        "mscale": rope.get("mscale"),
        "mscale_all_dim": rope.get("mscale_all_dim"),
        "truncate": rope.get("truncate", True),
    }
    return RopeScaling(type=kind, factor=factor, **{k: v for k, v in options.items() if k in used})


def _hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` of transformers for ``cfg.rope_theta`` and ``cfg.rope_scaling`` (inverse of
    :func:`_rope_scaling`)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is None:
        return params
    params |= {"rope_type": s.type, "factor": s.factor}
    if s.type in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = s.original_max_seq_len
    if s.type == "llama3":
        params |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor}
    if s.type == "yarn":
        params |= {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
        optional = {
            "attention_factor": s.attention_factor,
            "mscale": s.mscale,
            "mscale_all_dim": s.mscale_all_dim,
        }
        params |= {k: v for k, v in optional.items() if v is not None}
    return params


def _llama_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    """Llama, and Mistral (no bias options, ``sliding_window``)."""
    rope = c.rope_parameters or {}
    return ModelConfig(
        arch="decoder",
        **_sizes(c),
        n_kv_head=c.num_key_value_heads,
        head_dim=c.head_dim,
        norm="rmsnorm",
        norm_bias=False,
        norm_eps=c.rms_norm_eps,
        activation=_lookup(_LLAMA_ACT, c.hidden_act, "LlamaConfig.hidden_act"),
        mlp_bias=getattr(c, "mlp_bias", False),
        attn_bias=getattr(c, "attention_bias", False),
        attention_window=getattr(c, "sliding_window", None) or 0,
        position="rope",
        rope_theta=rope.get("rope_theta", 1e4),
        rope_scaling=_rope_scaling(rope, c.max_position_embeddings),
        tie_embeddings=tied,
        attn_dropout=c.attention_dropout,
        init="bert",
        init_std=c.initializer_range,
        pad_token_id=c.pad_token_id,
        eos_token_id=_first(c.eos_token_id),
    )


def _rope_decoder_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """LlamaConfig / MistralConfig arguments the two share."""
    act = {v: k for k, v in _LLAMA_ACT.items() if k != "gelu_new"}.get(cfg.activation, "silu")
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": act,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _hf_rope_parameters(cfg),
        "attention_dropout": cfg.attn_dropout,
        "initializer_range": cfg.init_std,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": cfg.eos_token_id,
    }


def _llama_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.LlamaConfig(
        **_rope_decoder_kwargs(cfg), attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias
    )


def _mistral_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    return transformers.MistralConfig(**_rope_decoder_kwargs(cfg), sliding_window=cfg.attention_window)


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    rules = _linear("embed.tok", ["model.embed_tokens"], False)
    for i in range(cfg.n_layer):
        ours, hf = f"decoder.blocks.{i}", f"model.layers.{i}"
        rules += _norm(f"{ours}.norm1", f"{hf}.input_layernorm", False)
        rules += _norm(f"{ours}.norm2", f"{hf}.post_attention_layernorm", False)
        attention = {n: f"{n}_proj" for n in "qkv"} | {"out": "o_proj"}
        rules += _projections(f"{ours}.attn", f"{hf}.self_attn", attention, cfg.attn_bias)
        mlp = {"gate": "gate_proj", "fc": "up_proj", "proj": "down_proj"}
        rules += _projections(f"{ours}.mlp", f"{hf}.mlp", mlp, cfg.mlp_bias)
    return rules + _norm("decoder.norm", "model.norm", False) + _linear("lm_head", ["lm_head"], False)


# ------------------------------------------------------------------------------------------------------ ModernBERT
_MODERNBERT_ACT = {
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "silu": "swiglu",
}
_MODERNBERT_HEAD_ACT = {"geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh", "swiglu": "silu"}  # the gate's


def _every_n_layers(layer_types: list[str]) -> int:
    """k of ``layer_types`` = ["full_attention" if i % k == 0 else "sliding_attention"]; ValueError otherwise."""
    n = len(layer_types)
    for k in range(1, n + 1):
        if layer_types == ["sliding_attention" if i % k else "full_attention" for i in range(n)]:
            return k
    raise InputError(
        f"ModernBertConfig.layer_types={layer_types} is not 'full_attention every k layers, sliding between'"
    )


def _modernbert_config(c: Any, tied: bool, head: bool, pooler: bool) -> ModelConfig:
    full, sliding = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    scaling = _rope_scaling(full, c.max_position_embeddings)
    if scaling != _rope_scaling(sliding, c.max_position_embeddings):
        raise InputError(
            "ModernBERT with a different rope scaling for full and sliding layers is not supported"
        )
    act = _lookup(_MODERNBERT_ACT, c.hidden_activation, "ModernBertConfig.hidden_activation")
    if c.classifier_activation != c.hidden_activation:
        raise InputError(
            f"ModernBertConfig.classifier_activation={c.classifier_activation!r} must equal hidden_activation "
            f"({c.hidden_activation!r}): our MLM head uses the MLP's activation"
        )
    k = _every_n_layers(list(c.layer_types))
    return ModelConfig(
        arch="encoder",
        **_sizes(c),
        norm="layernorm",
        norm_bias=c.norm_bias,
        norm_eps=c.norm_eps,
        norm_position="pre",
        embedding_norm=True,
        activation=act,
        mlp_bias=c.mlp_bias,
        attn_bias=c.attention_bias,
        position="rope",
        rope_theta=full["rope_theta"],
        rope_scaling=scaling,
        global_attn_every_n_layers=k,
        local_attention_window=c.local_attention // 2 + 1 if k > 1 else 0,  # |q - k| <= local_attention / 2
        local_rope_theta=sliding["rope_theta"] if k > 1 else None,
        tie_embeddings=tied,
        lm_head_bias=c.decoder_bias,
        mlm_head_transform=True,
        mlm_head_bias=c.classifier_bias,
        dropout=c.embedding_dropout,
        attn_dropout=c.attention_dropout,
        init="gpt2",
        init_std=c.initializer_range,
        pad_token_id=c.pad_token_id,
        eos_token_id=_first(c.eos_token_id),
    )


def _modernbert_hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    k = cfg.global_attn_every_n_layers
    full = _hf_rope_parameters(cfg)
    sliding = {**full, "rope_theta": cfg.local_rope_theta if k > 1 else cfg.rope_theta}
    return transformers.ModernBertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        hidden_activation=_MODERNBERT_HEAD_ACT.get(cfg.activation, "gelu"),
        classifier_activation=_MODERNBERT_HEAD_ACT.get(cfg.activation, "gelu"),
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        norm_eps=cfg.norm_eps,
        norm_bias=cfg.norm_bias,
        attention_bias=cfg.attn_bias,
        mlp_bias=cfg.mlp_bias,
        decoder_bias=cfg.lm_head_bias,
        classifier_bias=cfg.mlm_head_bias,
        attention_dropout=cfg.attn_dropout,
        embedding_dropout=cfg.dropout,
        mlp_dropout=cfg.dropout,
        global_attn_every_n_layers=k,
        local_attention=2 * (cfg.local_attention_window - 1) if k > 1 else 128,
        rope_parameters={"full_attention": full, "sliding_attention": sliding},
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        bos_token_id=None,
        cls_token_id=None,
        sep_token_id=None,
    )


def _modernbert_rules(cfg: ModelConfig) -> list[Rule]:
    rules = _linear("embed.tok", ["model.embeddings.tok_embeddings"], False)
    rules += _norm("embed.norm", "model.embeddings.norm", cfg.norm_bias)
    for i in range(cfg.n_layer):
        ours, hf = f"encoder.blocks.{i}", f"model.layers.{i}"
        if i > 0:  # layer 0 reads the normed embeddings (its attn_norm is an Identity)
            rules += _norm(f"{ours}.norm1", f"{hf}.attn_norm", cfg.norm_bias)
        rules += _linear([f"{ours}.attn.{n}" for n in "qkv"], [f"{hf}.attn.Wqkv"], cfg.attn_bias)
        rules += _linear(f"{ours}.attn.out", [f"{hf}.attn.Wo"], cfg.attn_bias)
        rules += _norm(f"{ours}.norm2", f"{hf}.mlp_norm", cfg.norm_bias)
        # Wi = [input; gate]: act(input) * gate, our act(gate(x)) * fc(x)
        rules += _linear([f"{ours}.mlp.gate", f"{ours}.mlp.fc"], [f"{hf}.mlp.Wi"], cfg.mlp_bias)
        rules += _linear(f"{ours}.mlp.proj", [f"{hf}.mlp.Wo"], cfg.mlp_bias)
    rules += _norm("encoder.norm", "model.final_norm", cfg.norm_bias)
    rules += _linear("mlm_transform.dense", ["head.dense"], cfg.mlm_head_bias)
    rules += _norm("mlm_transform.norm", "head.norm", cfg.norm_bias)
    return rules + _linear("lm_head", ["decoder"], cfg.lm_head_bias)


@dataclass(frozen=True)
class _Family:
    name: str
    config: Callable[[Any, bool, bool, bool], ModelConfig]  # (HF config, tied, has LM head, has pooler)
    hf_config: Callable[[ModelConfig, Any], Any]
    rules: Callable[[ModelConfig], list[Rule]]


_GPT2 = _Family("GPT2LMHeadModel", _gpt2_config, _gpt2_hf_config, _gpt2_rules)
_BERT = _Family("BertForMaskedLM", _bert_config, _bert_hf_config, _bert_rules)
_T5 = _Family("T5ForConditionalGeneration", _t5_config, _t5_hf_config, _t5_rules)
_LLAMA = _Family("LlamaForCausalLM", _llama_config, _llama_hf_config, _llama_rules)
_BIGBIRD = _Family("BigBirdForMaskedLM", _bigbird_config, _bigbird_hf_config, _bigbird_rules)
_MISTRAL = _Family("MistralForCausalLM", _llama_config, _mistral_hf_config, _llama_rules)
_MODERNBERT = _Family("ModernBertForMaskedLM", _modernbert_config, _modernbert_hf_config, _modernbert_rules)
_BY_CLASS = {f.name: f for f in (_GPT2, _BERT, _BIGBIRD, _T5, _LLAMA, _MISTRAL, _MODERNBERT)}
_BY_CLASS["BertModel"] = _BERT


def _family_of(cfg: ModelConfig) -> _Family:
    if cfg.arch == "encoder-decoder":
        return _T5
    if cfg.arch == "encoder":
        if cfg.position == "rope":
            return _MODERNBERT
        return _BIGBIRD if cfg.lm_head and cfg.pooler else _BERT
    if cfg.position == "rope":
        return _MISTRAL if cfg.attention_window else _LLAMA
    return _GPT2


def _hf_class_name(cfg: ModelConfig) -> str:
    family = _family_of(cfg)
    return "BertModel" if family is _BERT and not cfg.lm_head else family.name


def _is_tied(hf_model: Any) -> bool:
    out = hf_model.get_output_embeddings()
    if out is None:
        return False
    a, b = out.weight, hf_model.get_input_embeddings().weight
    return a is b or (a.device.type != "meta" and a.data_ptr() == b.data_ptr())  # meta: every address is 0


def from_hf(hf_model: Any) -> Transformer:
    """A :class:`Transformer` with the architecture and weights of a transformers GPT2LMHeadModel,
    BertForMaskedLM, BertModel (no LM head; pooler kept), BigBirdForMaskedLM (original_full),
    T5ForConditionalGeneration, LlamaForCausalLM, MistralForCausalLM or ModernBertForMaskedLM."""
    name = type(hf_model).__name__
    if name not in _BY_CLASS:
        raise InputError(f"from_hf supports {sorted(_BY_CLASS)}, got {name}")
    family = _BY_CLASS[name]
    head = name != "BertModel"
    pooler = getattr(hf_model.base_model, "pooler", None) is not None  # BigBirdForMaskedLM keeps one
    config = family.config(hf_model.config, _is_tied(hf_model) if head else True, head, pooler)
    hf_state = hf_model.state_dict()
    model = Transformer(config)
    rows = {k: v.shape[0] for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for ours, keys, transpose in family.rules(config):
        parts = torch.cat([hf_state[k].t() if transpose else hf_state[k] for k in keys])
        state.update(zip(ours, parts.split([rows[k] for k in ours]), strict=True))
    model.load_state_dict(state, strict=True)
    return model.to(hf_model.dtype).train(hf_model.training)


Fold = tuple[str, float, float]  # (the tensor it is made from, divided by, then times)


def _mup_folds(model: Transformer) -> tuple[ModelConfig, dict[str, Fold]]:
    """The standard config computing what muP ``model`` (its modules only: it may be on the meta device) computes,
    and the tensors that change: key -> (the key it is made from, divisor, factor) (see
    :func:`standard_equivalent`)."""
    cfg = model.config
    m, tied = cfg.width_mult, cfg.tie_embeddings and cfg.lm_head
    into_norm: str | None
    if model.mlm_transform is not None:
        into_norm = "mlm_transform.norm"
    else:
        into_norm = "decoder.norm" if tied and cfg.arch == "encoder-decoder" else None
    into_head = cfg.lm_head and into_norm is None
    folded = dataclasses.replace(
        cfg,
        parametrization="standard",
        mup_attn_multiplier=1.0,
        tie_embeddings=cfg.tie_embeddings and (m == 1.0 or not into_head),
    )
    keys = set(model.state_dict())
    folds: dict[str, Fold] = {}
    if into_head:
        folds["lm_head.weight"] = ("embed.tok.weight" if tied and m != 1.0 else "lm_head.weight", m, 1.0)
    elif cfg.lm_head:
        folds |= {k: (k, m, 1.0) for k in (f"{into_norm}.weight", f"{into_norm}.bias") if k in keys}
    if cfg.attn_scale == "default":
        factor = cfg.mup_attn_multiplier * cfg.sizes.head_dim**-0.5
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                queries = [f"{name}.q_norm.weight"] if cfg.qk_norm else [f"{name}.q.weight", f"{name}.q.bias"]
                folds |= {k: (k, 1.0, factor) for k in queries if k in keys}
    return folded, folds


def _folded(tensor: torch.Tensor, fold: Fold) -> torch.Tensor:
    """``tensor`` / divisor * factor (a new tensor; a 1.0 skipped)."""
    _, divisor, factor = fold
    out = tensor / divisor if divisor != 1.0 else tensor.clone()
    return out * factor if factor != 1.0 else out


@torch.no_grad()
def standard_equivalent(model: Transformer) -> Transformer:
    """``model`` under standard parametrization, computing the same function: muP's multipliers folded into the
    weights. Attention a q k^T / d_h = (a d_h^-1/2 q) k^T / sqrt(d_h): the query rows (or the q_norm gain) times
    a d_h^-1/2 (a = ``mup_attn_multiplier``). Logits W (t / m) + b with t = norm(x) g + beta: into that norm (g / m, beta / m) -- BERT's head
    transform (the encoder's outputs unchanged), or a tied T5's final decoder norm (its decoder states scale by
    1/m; tied so that transformers' re-tying, e.g. in lm-eval, cannot swap the head); otherwise (W / m) h, the LM
    head times 1/m, untied from the embedding when it was tied. Returns ``model`` itself under standard
    parametrization."""
    if model.config.parametrization == "standard":
        return model
    config, folds = _mup_folds(model)
    folded = Transformer(config)
    state = model.state_dict()
    state |= {k: _folded(state[fold[0]], fold) for k, fold in folds.items()}
    folded.load_state_dict(state, strict=True)
    return folded.to(next(model.parameters()).dtype).train(model.training)


def _absent_biases(cfg: ModelConfig) -> dict[str, Any]:
    """The bias fields GPT-2, BERT and BigBird always have that ``cfg`` lacks, each set True (RMSNorm has no bias)."""
    absent = [f for f in ("attn_bias", "mlp_bias") if not getattr(cfg, f)]
    if cfg.norm == "layernorm" and not cfg.norm_bias:
        absent.append("norm_bias")
    return dict.fromkeys(absent, True)


@torch.no_grad()
def with_zero_biases(model: Transformer) -> Transformer:
    """``model`` with the LayerNorm, attention and MLP biases that GPT-2, BERT and BigBird always have, as zeros
    where ``model`` has none (nanoGPT's bias-free layout): the same function. Returns ``model`` itself when it
    lacks none of them (or uses RMSNorm, which has no bias to add)."""
    cfg = model.config
    absent = _absent_biases(cfg)
    if not absent:
        return model
    biased = Transformer(dataclasses.replace(cfg, **absent))
    ours = model.state_dict()
    state = {}
    for key, tensor in biased.state_dict().items():
        assert key in ours or key.endswith(".bias"), key  # only biases are new
        state[key] = ours[key].clone() if key in ours else torch.zeros_like(tensor)
    biased.load_state_dict(state, strict=True)
    return biased.to(next(model.parameters()).dtype).train(model.training)


def _checked_hf_config(cfg: ModelConfig, transformers: Any) -> tuple[_Family, Any]:
    """``cfg``'s family and transformers config; ``InputError`` naming the fields when the config that converts
    back differs (HF cannot express the model)."""
    family = _family_of(cfg)
    hf_config = family.hf_config(cfg, transformers)
    back = family.config(hf_config, cfg.tie_embeddings, cfg.lm_head, cfg.pooler)
    ignored = _UNCHECKED | ({"max_seq_len"} if cfg.position == "relative" else set())
    if not cfg.attention_random_blocks:  # block size and seed only shape the random blocks
        ignored |= {"attention_block_size", "attention_seed"}
    diff = [
        f.name
        for f in dataclasses.fields(cfg)
        if f.name not in ignored and getattr(cfg, f.name) != getattr(back, f.name)
    ]
    if diff:
        fields = ", ".join(f"{k}={getattr(cfg, k)!r} (HF gives {getattr(back, k)!r})" for k in diff)
        raise InputError(f"{_hf_class_name(cfg)} cannot express this model: {fields}")
    return family, hf_config


def _new_hf_model(cfg: ModelConfig, hf_config: Any, transformers: Any) -> Any:
    """The transformers model of ``cfg`` (random weights; under ``torch.device("meta")``, none), its LM head
    untied where ``cfg``'s is."""
    hf_model = getattr(transformers, _hf_class_name(cfg))(hf_config)
    if cfg.lm_head and not cfg.tie_embeddings and _is_tied(hf_model):  # transformers 5 T5 always ties lm_head
        out = hf_model.get_output_embeddings()
        out.weight = nn.Parameter(out.weight.detach().clone())
        hf_model.all_tied_weights_keys = {
            k: v for k, v in hf_model.all_tied_weights_keys.items() if not k.startswith("lm_head")
        }
    return hf_model


# untied BERT: cls.predictions.bias, unused, is set equal to the decoder's bias (see _bert_rules)
_TWINS = {"cls.predictions.bias": "cls.predictions.decoder.bias"}


def _sources(rules: list[Rule], hf_keys: Any) -> dict[str, tuple[Rule, str]]:
    """Every HF key the rules give -> (its rule, the key of the rule's part it holds: itself, or a twin's)."""
    sources = {k: (rule, k) for rule in rules for k in rule[1]}
    sources |= {twin: sources[of] for twin, of in _TWINS.items() if of in sources and twin in hf_keys}
    return sources


def _parts(
    rule: Rule,
    get: Callable[[str], torch.Tensor],
    hf_shapes: dict[str, Any],
    empty: Callable[[torch.Size, torch.dtype], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The HF tensors of one rule: our tensors (``get``) concatenated along dim 0 (into ``empty(shape, dtype)``),
    split in the HF tensors' rows, each transposed where the rule says (views of our tensor when the rule has
    one)."""
    mine, keys, transpose = rule
    sizes = [hf_shapes[k][-1 if transpose else 0] for k in keys]
    if len(mine) == 1:
        whole = get(mine[0])
    else:
        tensors = [get(m) for m in mine]
        shape = torch.Size([sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]])
        out = torch.empty(shape, dtype=tensors[0].dtype) if empty is None else empty(shape, tensors[0].dtype)
        whole = torch.cat(tensors, out=out)
    return {k: p.t() if transpose else p for k, p in zip(keys, whole.split(sizes), strict=True)}


def _check_mapping(sources: dict[str, Any], hf_keys: Any, hf_model: Any) -> None:
    """``RuntimeError`` when the rules give a key the HF model lacks, or miss one it does not tie."""
    unexpected = sorted(set(sources) - set(hf_keys))
    untied = sorted(set(hf_keys) - set(sources) - set(hf_model.all_tied_weights_keys))
    if unexpected or untied:
        raise RuntimeError(f"weight mapping mismatch: missing {untied}, unexpected {unexpected}")


def to_hf(model: Transformer) -> Any:
    """The equivalent transformers model (same weights, same outputs); ValueError if no supported HF class can
    express ``model.config``. muP models export through :func:`standard_equivalent`, bias-free GPT-2 / BERT /
    BigBird layouts through :func:`with_zero_biases`."""
    import transformers

    model = standard_equivalent(model)
    if _family_of(model.config) in (_GPT2, _BERT, _BIGBIRD):
        model = with_zero_biases(model)
    cfg = model.config
    family, hf_config = _checked_hf_config(cfg, transformers)
    hf_model = _new_hf_model(cfg, hf_config, transformers)
    ours, hf_shapes = model.state_dict(), {k: v.shape for k, v in hf_model.state_dict().items()}
    rules = family.rules(cfg)
    sources = _sources(rules, hf_shapes)
    _check_mapping(sources, hf_shapes, hf_model)
    state: dict[str, torch.Tensor] = {}
    for rule in rules:
        state |= _parts(rule, ours.__getitem__, hf_shapes)
    state |= {k: state[part] for k, (_, part) in sources.items()}  # the twins
    hf_model.load_state_dict(state, strict=False)  # the tied keys missing
    return hf_model.to(next(model.parameters()).dtype).train(model.training)


_SEQUENCE_CLASSIFIERS = {  # the model to_hf exports -> the transformers class with the same sequence head
    "BertModel": "BertForSequenceClassification",
    "GPT2LMHeadModel": "GPT2ForSequenceClassification",
    "LlamaForCausalLM": "LlamaForSequenceClassification",
    "MistralForCausalLM": "MistralForSequenceClassification",
}


def _check_classifier(model: TaskModel) -> None:
    """``ValueError`` in one line when no transformers class computes ``model``'s logits."""
    cfg, pooling = model.backbone.config, model.pooling
    if model.kind != "sequence":
        raise InputError(
            f"head.kind={model.kind!r} has no transformers export; export a sequence head or a text2text model"
        )
    if cfg.arch == "encoder-decoder":
        raise InputError(
            "transformers' T5ForSequenceClassification classifies the decoder's state at the last EOS; this head "
            f"pools the encoder output ({pooling!r}), which no transformers class computes; finetune T5 with "
            "head.kind=text2text to export it"
        )
    if cfg.arch == "encoder" and cfg.position == "rope":
        raise InputError(
            "ModernBertForSequenceClassification runs its prediction head (dense + activation + norm) on the "
            f"pooled state before its classifier; this head classifies the {pooling!r}-pooled state directly, which "
            "no transformers class computes; evaluate it with pretrain, or export the pretraining checkpoint"
        )
    if cfg.arch == "encoder" and pooling != "pooler":
        raise InputError(
            "BertForSequenceClassification classifies BERT's pooler output tanh(dense(h[:, 0])); this head pools "
            f"{pooling!r}, which no transformers class computes; finetune with head.pooling=pooler (a backbone "
            "with model.pooler: true) to export it"
        )


@torch.no_grad()
def classifier_to_hf(model: TaskModel, label_names: list[str] | None = None) -> Any:
    """The transformers sequence classifier of a finetuned ``TaskModel`` (same logits): BERT's pooler head ->
    ``BertForSequenceClassification`` (``classifier``); a decoder's last-token head ->
    ``GPT2ForSequenceClassification`` / ``LlamaForSequenceClassification`` / ``MistralForSequenceClassification``
    (``score``, no bias; transformers takes the last token that is not ``pad_token_id``, which the tokenizer's
    ids set by :func:`save_hf`). One output is ``problem_type="regression"``. ValueError in one line when
    transformers cannot represent the head (``_check_classifier``)."""
    import transformers

    _check_classifier(model)
    cfg = model.backbone.config
    if cfg.arch == "encoder":  # BertModel under the classifier; the MLM head is gone
        cfg = dataclasses.replace(cfg, lm_head=False, mlm_head_transform=False, lm_head_bias=False)
    base = Transformer(cfg)
    missing, unexpected = base.load_state_dict(model.backbone.state_dict(), strict=False)
    if unexpected or any(not k.startswith("lm_head.") for k in missing):  # a decoder's unused untied LM head
        raise RuntimeError(f"backbone mismatch: missing {missing}, unexpected {unexpected}")
    hf_base = to_hf(base.to(next(model.parameters()).dtype))
    config = hf_base.config
    K = model.head.out.out_features
    config.num_labels = K
    config.problem_type = "regression" if K == 1 else "single_label_classification"
    if label_names and len(label_names) == K:
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: i for i, name in enumerate(label_names)}
    hf_model = getattr(transformers, _SEQUENCE_CLASSIFIERS[type(hf_base).__name__])(config)
    hf_model.base_model.load_state_dict(hf_base.base_model.state_dict(), strict=True)
    head = hf_model.classifier if cfg.arch == "encoder" else hf_model.score
    head.load_state_dict(model.head.out.state_dict(), strict=True)
    return hf_model.to(hf_base.dtype).train(model.training)


def hf_tokenizer(tokenizer: Any, max_length: int, special_tokens: dict[str, str] | None = None) -> Any:
    """A transformers fast tokenizer of a ``tokenizers.Tokenizer`` with every special-token role it holds
    (``pretrain.datamodules.special_tokens``: eos, bos, pad, unk, mask, cls, sep; ``special_tokens`` overrides a role's
    token, e.g. ``eos: <|endoftext|>``), T5's ``<extra_id_i>`` sentinels, and ``model_max_length``."""
    import transformers

    from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, NUM_SENTINELS, sentinel_token

    roles = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
    present = {f"{role}_token": tok for role, tok in roles.items() if tokenizer.token_to_id(tok) is not None}
    sentinels = [s for s in map(sentinel_token, range(NUM_SENTINELS)) if tokenizer.token_to_id(s) is not None]
    extra = {"additional_special_tokens": sentinels} if sentinels else {}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=max_length, **present, **extra
    )


def special_token_ids(tokenizer: Any, special_tokens: dict[str, str] | None = None) -> dict[str, int]:
    """``{"bos_token_id": .., "eos_token_id": .., "pad_token_id": ..}`` of the roles the tokenizer holds
    (``pretrain.datamodules.special_tokens``; ``special_tokens`` overrides a role's token)."""
    from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS

    roles = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
    ids = {role: tokenizer.token_to_id(roles[role]) for role in ("bos", "eos", "pad")}
    return {f"{role}_token_id": i for role, i in ids.items() if i is not None}


def set_token_ids(hf_model: Any, ids: dict[str, int]) -> None:
    """Write the tokenizer's special-token ids into the model config and ``generation_config``: ``generate()``
    and ``pipeline`` then stop at eos as ``pretrain generate`` does (the tokenizer, not the model YAML, is the
    source of the ids)."""
    for config in (hf_model.config, getattr(hf_model, "generation_config", None)):  # encoders: none
        if config is not None:
            for key, value in ids.items():
                setattr(config, key, value)


def _tokenizer(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` of ``tokenizer`` (one, a tokenizer.json or a directory holding one, or None)."""
    from tokenizers import Tokenizer

    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    tokenizer_file = Path(tokenizer)
    if tokenizer_file.is_dir():
        tokenizer_file = tokenizer_file / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json at {tokenizer_file}")
    return Tokenizer.from_file(str(tokenizer_file))


_SHARD_BYTES = 50 * 10**9  # save_pretrained's max_shard_size ("50GB"): above it, the weights are sharded


def _write(
    hf_model: Any,
    out_dir: str | Path,
    tokenizer: Any,
    special_tokens: dict[str, str] | None,
    max_length: int,
    weights: Callable[[Path], None] | None = None,
) -> Path:
    """``out_dir`` as :func:`save_hf` writes it for ``hf_model``; ``weights(directory)``: the weights written there
    by the caller (``hf_model``, on the meta device, gives the config files only)."""
    out_dir = Path(out_dir)
    if tokenizer is not None:
        set_token_ids(hf_model, special_token_ids(tokenizer, special_tokens))
    with staged_directory(out_dir) as staging:  # out_dir never holds half an export
        if weights is None:
            hf_model.save_pretrained(staging, safe_serialization=True, max_shard_size=_SHARD_BYTES)
        else:
            hf_model.save_pretrained(staging, state_dict={})  # config.json, generation_config.json
            weights(staging)
        if tokenizer is not None:
            hf_tokenizer(tokenizer, max_length, special_tokens).save_pretrained(staging)
        permissions_as_umask(staging)  # transformers writes the weights through a 0600 temporary file
    return out_dir


def save_hf(
    model: Transformer | TaskModel,
    out_dir: str | Path,
    tokenizer: Any = None,
    special_tokens: dict[str, str] | None = None,
    label_names: list[str] | None = None,
) -> Path:
    """Write ``out_dir/config.json`` + ``model.safetensors`` (transformers ``from_pretrained`` format) and, given
    ``tokenizer`` (a ``tokenizers.Tokenizer``, a tokenizer.json or a directory holding one), the tokenizer files
    with the special tokens and ``model_max_length`` set (``hf_tokenizer``), and the tokenizer's bos/eos/pad ids in
    ``config.json`` and ``generation_config.json`` (``set_token_ids``): ``AutoTokenizer``, ``generate``,
    ``pipeline`` and lm-eval's ``hf`` model work on the directory alone. A finetuned ``TaskModel`` is written as
    its transformers sequence classifier (:func:`classifier_to_hf`, ``label_names`` as ``id2label``)."""
    tokenizer = _tokenizer(tokenizer)
    hf_model = classifier_to_hf(model, label_names) if isinstance(model, TaskModel) else to_hf(model)
    backbone = model.backbone if isinstance(model, TaskModel) else model
    return _write(hf_model, out_dir, tokenizer, special_tokens, backbone.config.max_seq_len)


def save_hf_streamed(
    config: ModelConfig,
    load: Callable[[str], torch.Tensor],
    out_dir: str | Path,
    tokenizer: Any = None,
    special_tokens: dict[str, str] | None = None,
) -> Path:
    """The files :func:`save_hf` writes for the :class:`Transformer` of ``config`` whose state-dict tensors
    ``load(key)`` gives (checked by the caller), byte for byte, one tensor in memory at a time. The transformers
    model is built on the meta device (no weights): its config and generation config are written from it, its
    state dict (tied weights dropped as ``save_pretrained`` drops them) gives the file's tensors, and each is made
    from ours by :func:`to_hf`'s rules (``_parts``: concatenated, split, transposed) when the writer reaches it
    (``pretrain.compat.hf_save.write_safetensors``), then dropped. ``load`` is called once for each of our tensors
    an HF tensor written reads (a tied LM head's never); its tensor is cast to the dtype of the model's parameters
    as ``load_state_dict`` casts it, muP's multipliers folded in as :func:`standard_equivalent` folds them
    (``_mup_folds``), missing biases of GPT-2 / BERT / BigBird are zeros (:func:`with_zero_biases`).
    Tensors made here (casts, concatenations) live in mappings of their own (``memory.unpooled``: malloc's heap
    kept the freed ones, +3 MiB per GPT-2 layer).
    Above 50 GB the weights are sharded as ``save_pretrained`` shards them (``model-0000i-of-0000n.safetensors``
    and the index)."""
    import transformers

    from pretrain.compat.hf_save import saved_keys, write_weights
    from pretrain.memory import unpooled

    tokenizer = _tokenizer(tokenizer)
    with torch.device("meta"):
        ours = Transformer(config)
    dtype = next(ours.parameters()).dtype
    cfg, folds = _mup_folds(ours) if config.parametrization != "standard" else (config, {})
    if _family_of(cfg) in (_GPT2, _BERT, _BIGBIRD):
        cfg = dataclasses.replace(cfg, **_absent_biases(cfg))  # with_zero_biases
    family, hf_config = _checked_hf_config(cfg, transformers)
    with torch.device("meta"):
        hf_model = _new_hf_model(cfg, hf_config, transformers).to(dtype)
        biased = Transformer(cfg)
    hf_shapes = {k: v.shape for k, v in hf_model.state_dict().items()}
    sources = _sources(family.rules(cfg), hf_shapes)
    _check_mapping(sources, hf_shapes, hf_model)
    keys = saved_keys(hf_model)
    present = set(ours.state_dict())

    def cast(key: str) -> torch.Tensor:
        tensor = load(key)
        if tensor.dtype == dtype:
            return tensor
        return unpooled(tensor.shape, dtype).copy_(tensor)

    def get(key: str) -> torch.Tensor:
        if key not in present:  # a bias with_zero_biases adds
            return torch.zeros(biased.get_parameter(key).shape, dtype=dtype)
        if key in folds:  # muP's multipliers (standard_equivalent)
            return _folded(cast(folds[key][0]), folds[key])
        return cast(key)

    def produce(key: str) -> torch.Tensor:
        rule, part = sources[key]
        return _parts(rule, get, hf_shapes, unpooled)[part]

    def weights(directory: Path) -> None:
        write_weights(directory, hf_model, keys, produce, _SHARD_BYTES)

    return _write(hf_model, out_dir, tokenizer, special_tokens, config.max_seq_len, weights)


def export_problem(directory: str | Path) -> str | None:
    """Why ``directory`` is not a complete transformers model directory (an interrupted export, a copy cut
    short), or None: ``config.json`` readable, and every weights file present and whole (safetensors headers
    checked against the file sizes; a sharded export's index lists only files that exist)."""
    directory = Path(directory)
    if STAGING_MARK in directory.name:
        return "it is the staging directory of an export that did not finish"
    try:
        json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        return "config.json is missing"
    except ValueError:
        return "config.json is not valid JSON (cut short?)"
    index = directory / "model.safetensors.index.json"
    try:
        weights = (
            sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
            if index.is_file()
            else sorted(directory.glob("*.safetensors"))
        )
    except (ValueError, KeyError):
        return f"{index.name} is not valid JSON (cut short?)"
    if not weights:
        return (
            None if any(directory.glob("pytorch_model*.bin")) else "it holds no weights (model.safetensors)"
        )
    from safetensors import SafetensorError, safe_open

    for path in weights:
        try:
            with safe_open(path, framework="pt"):
                pass
        except FileNotFoundError:
            return f"{path.name} is missing"
        except (SafetensorError, OSError) as err:
            return f"{path.name} is damaged or cut short ({str(err).splitlines()[0]})"
    return None


def check_export(directory: str | Path) -> None:
    """``InputError`` naming what is missing when ``directory`` is an incomplete transformers directory."""
    if problem := export_problem(directory):
        raise InputError(
            f"{directory} is not a complete transformers model directory ({problem}): an interrupted export "
            "leaves one; export the checkpoint again (pretrain export CHECKPOINT DIR --force)"
        )
