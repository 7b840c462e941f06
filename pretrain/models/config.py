"""Architecture as data: one typed, validated dataclass describes GPT, BERT, T5 and Llama style transformers.

Every option is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field, the allowed
values and the value given. ``None`` fields are resolved to their defaults there (``n_kv_head = n_head``,
``head_dim = d_model // n_head``, ``d_ff = 4 * d_model``, ``n_decoder_layer = n_layer``), so a resolved config
round-trips through ``dataclasses.asdict`` and OmegaConf structured configs. Those four fields stay ``int | None``
(``None`` = derive it, in YAML, overrides and keyword arguments alike); model code reads their resolved values,
typed ``int``, as ``ModelConfig.sizes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from pretrain.errors import InputError

ARCHS = ("decoder", "encoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("relu", "relu2", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh", "reglu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "reglu")
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "none")
ATTN_SCALES = ("default", "none")
INITS = ("gpt2", "t5", "bert")
ATTENTIONS = ("sdpa", "flex")
PARAMETRIZATIONS = ("standard", "mup")
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")
# a block's linear layers by name: attention (self and cross) q, k, v, out; MLP gate (GLU only), fc, proj
BLOCK_LINEARS = ("q", "k", "v", "out", "gate", "fc", "proj")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"ModelConfig.{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"ModelConfig.{name} must be a positive integer, got {value!r}")


def _in_range(name: str, value: object, low: int, high: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InputError(f"ModelConfig.{name} must be an integer in [{low}, {high}] ({why}), got {value!r}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise InputError(f"ModelConfig.{name} must be in [0, 1), got {value!r}")


@dataclass
class RopeScaling:
    """Context extension of RoPE, as transformers computes it (``transformers.modeling_rope_utils``; the math is in
    :mod:`pretrain.models.rope`). ``factor`` s = extended / original context; ``original_max_seq_len`` L is the
    context the model was trained at (default ``max_seq_len``):

    - ``linear`` (position interpolation, Chen et al. 2023): every frequency / s.
    - ``dynamic`` (dynamic NTK): at a call whose longest position is n > L, theta * (s n / L - (s - 1))^(d/(d-2));
      the original frequencies up to L. transformers' semantics: its L is ``max_position_embeddings`` (export
      needs ``original_max_seq_len == max_seq_len``), and keys already in a KV cache keep the rotation they got.
    - ``yarn`` (Peng et al. 2023): frequencies of wavelength below L / ``beta_fast`` rotations kept, above
      L / ``beta_slow`` divided by s, a linear ramp between; cos/sin scaled by ``attention_factor`` (default
      0.1 ln s + 1, or from ``mscale`` / ``mscale_all_dim``).
    - ``llama3`` (Llama 3.1): wavelengths above L / ``low_freq_factor`` divided by s, below L / ``high_freq_factor``
      kept, smoothly interpolated between.
    """

    type: str | None = None  # linear | dynamic | yarn | llama3
    factor: float | None = None  # s >= 1
    original_max_seq_len: int | None = None  # L: dynamic, yarn, llama3 (default max_seq_len)
    low_freq_factor: float | None = None  # llama3 (required)
    high_freq_factor: float | None = None  # llama3 (required, > low_freq_factor)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale (default from factor, mscale, mscale_all_dim)
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions

    USES: ClassVar[dict[str, frozenset[str]]] = {
        "linear": frozenset(),
        "dynamic": frozenset({"original_max_seq_len"}),
        "yarn": frozenset(
            {"original_max_seq_len", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"}
            | {"truncate"}
        ),
        "llama3": frozenset({"original_max_seq_len", "low_freq_factor", "high_freq_factor"}),
    }

    def resolve(self, max_seq_len: int) -> None:
        """Check every field against ``type``, in one line each (``ValueError``); default ``original_max_seq_len``."""
        where = "ModelConfig.rope_scaling"
        if self.type not in ROPE_SCALINGS:
            raise InputError(f"{where}.type must be one of {list(ROPE_SCALINGS)}, got {self.type!r}")
        defaults = RopeScaling()
        for f in fields(self):
            unused = f.name not in ("type", "factor", *self.USES[self.type])
            if unused and getattr(self, f.name) != getattr(defaults, f.name):
                raise InputError(
                    f"{where}.{f.name} is not used by type {self.type!r}; remove it (it is for "
                    f"{[t for t, used in self.USES.items() if f.name in used]})"
                )
        if isinstance(self.factor, bool) or not isinstance(self.factor, int | float) or self.factor < 1:
            raise InputError(
                f"{where}.factor is required for type {self.type!r}: the extended / original context ratio "
                f"(>= 1, e.g. 8 for 128 -> 1024 tokens), got {self.factor!r}"
            )
        if "original_max_seq_len" in self.USES[self.type]:
            if self.original_max_seq_len is None:
                self.original_max_seq_len = max_seq_len
            _positive("rope_scaling.original_max_seq_len", self.original_max_seq_len)
        if self.type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None or not 0 < low < high:
                raise InputError(
                    f"{where}.low_freq_factor and high_freq_factor are required for type 'llama3', with "
                    f"0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4), got {low!r} and {high!r}"
                )
        if self.type == "yarn":
            if not 0 < self.beta_slow <= self.beta_fast:
                raise InputError(
                    f"{where} needs 0 < beta_slow <= beta_fast (default 1 and 32), got {self.beta_slow!r} and "
                    f"{self.beta_fast!r}"
                )
            if self.attention_factor is not None and not self.attention_factor > 0:
                raise InputError(f"{where}.attention_factor must be > 0, got {self.attention_factor!r}")


@dataclass(frozen=True)
class Sizes:
    """The sizes a :class:`ModelConfig` may leave ``None``, as its ``__post_init__`` resolved them."""

    head_dim: int  # d_h
    n_kv_head: int  # g
    d_ff: int  # MLP width (per branch for gated activations)
    n_decoder_layer: int  # decoder layers of an encoder-decoder (n_layer for the other archs)


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`pretrain.models.transformer.Transformer`.

    Shapes: ``d_model`` = d, ``n_head`` = h query heads of ``head_dim`` = d_h, ``n_kv_head`` = g key/value heads
    (grouped-query attention when g < h), ``d_ff`` = MLP width (per branch for gated activations).

    Every field identifies the weights (their shapes and the function they compute) except ``RUN_TIME``: the
    attention backend (same function), dropout (training only), the initialisation (``init``, ``init_std``,
    ``zero_init_projections``: fresh weights only) and the
    special-token ids (the tokenizer's). A checkpoint resumes under any run-time settings (``identity``).
    """

    RUN_TIME: ClassVar[frozenset[str]] = frozenset(
        {
            "attention",
            "dropout",
            "attn_dropout",
            "init",
            "init_std",
            "zero_init_projections",
            "pad_token_id",
            "eos_token_id",
            "decoder_start_token_id",
        }
    )

    arch: str = "decoder"  # decoder (GPT, causal) | encoder (BERT, bidirectional) | encoder-decoder (T5)
    vocab_size: int = 50304
    d_model: int = 768
    n_layer: int = 12  # encoder layers for encoder-decoder
    n_decoder_layer: int | None = None  # decoder layers for encoder-decoder (default n_layer)
    n_head: int = 12
    n_kv_head: int | None = None  # default n_head (multi-head); 1 = multi-query
    head_dim: int | None = None  # default d_model // n_head; T5 and Llama may set it freely
    d_ff: int | None = None  # default 4 * d_model
    max_seq_len: int = 1024  # longest sequence (enforced for learned / sinusoidal positions)

    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_bias: bool = True  # LayerNorm bias (rmsnorm has none)
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # pre: x + f(norm(x)), final norm per stack | post: norm(x + f(x)) (BERT)
    embedding_norm: bool = False  # norm after summing the embeddings (BERT)

    activation: str = (
        "gelu_tanh"  # relu | relu2 (relu(x)^2, Primer) | gelu | gelu_tanh | swiglu | geglu | ...
    )
    mlp_bias: bool = True
    attn_bias: bool = True
    attn_scale: str = "default"  # default: softmax(q k^T / sqrt(d_h)) | none: softmax(q k^T) (T5)
    qk_norm: bool = False  # RMSNorm (learned gain, per head over d_h) on q and k before RoPE (OLMo 2, Qwen 3)

    position: str = "learned"  # learned | sinusoidal | rope | relative (T5 buckets) | none
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # context extension (RopeScaling: linear, dynamic, yarn, llama3)
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    type_vocab_size: int = 0  # BERT segment embeddings; 0 = none

    tie_embeddings: bool = True  # LM head weight = token embedding
    lm_head: bool = True  # False: backbone only (logits None), e.g. BertModel
    lm_head_bias: bool = False  # per-token output bias (BERT)
    logit_scale: float = 1.0  # multiplies the final hidden states before the LM head (T5 v1.0: d**-0.5)
    mlm_head_transform: bool = False  # BERT MLM head: dense + activation + norm before the LM head
    mlm_head_bias: bool = True  # bias of that dense (ModernBERT has none)
    pooler: bool = False  # BERT pooler: tanh(dense(first token))

    dropout: float = 0.0  # embeddings and every residual branch
    attn_dropout: float = 0.0  # attention probabilities

    # Attention backend and sparse long-context pattern (pretrain.models.attention). The sparse fields combine
    # as in BigBird: sliding window | global tokens | random blocks, then causality, documents and padding.
    attention: str = "sdpa"  # sdpa (F.scaled_dot_product_attention, dense masks) | flex (flex_attention)
    attention_window: int = (
        0  # sliding window: decoder 0 <= q - k < w (Mistral), encoder |q - k| < w; 0 = off
    )
    attention_global_tokens: int = 0  # the first k positions attend to and are attended by every position
    attention_global_token_ids: list[int] = field(
        default_factory=list
    )  # encoder tokens global wherever they occur
    attention_random_blocks: int = 0  # BigBird: r random key blocks per query block (seeded, reproducible)
    attention_block_size: int = 128  # block of the random pattern and of flex's BlockMask
    attention_seed: int = 0  # seed of the random-block pattern
    # Per-layer pattern (ModernBERT; Gemma 2 for decoders): layer i of a stack is global when
    # i % global_attn_every_n_layers == 0 (the pattern above, rope_theta), else local: the same pattern with the
    # window local_attention_window and RoPE base local_rope_theta. ModernBERT: every 3rd, window 65, theta 1e4.
    global_attn_every_n_layers: int = 1  # 1: every layer global, no local layers
    local_attention_window: int = (
        0  # the local layers' window (attention_window's rule); > 0 with local layers
    )
    local_rope_theta: float | None = None  # RoPE base of the local layers (default rope_theta)

    init: str = "gpt2"  # gpt2 (N(0, std), residual projections std/sqrt(2L)) | bert (N(0, std)) | t5 (fan-in)
    init_std: float = 0.02
    zero_init_projections: bool = (
        False  # attention output and MLP down projections start at 0 (modded-nanogpt)
    )

    # muP (Yang et al. 2022, "Tensor Programs V"; pretrain.models.mup): hidden init std / sqrt(m), attention
    # softmax(a q k^T / d_h), logits W h / m, Adam LR (and Muon's AdamW part) / m on hidden matrices, with the width
    # multiplier m = d_model / mup_base_width; d_ff and n_head * d_h are assumed to scale with d_model.
    parametrization: str = "standard"  # standard | mup
    mup_base_width: int = 128  # d_model of the base model whose tuned hyper-parameters transfer
    # a, the `mup` package's attn_mult: sqrt(d_h of the base model) makes the base model's attention the standard
    # q k^T / sqrt(d_h) (what transfers is a / d_h); 1 is Tensor Programs V's plain 1/d_h
    mup_attn_multiplier: float = 1.0

    pad_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None  # encoder-decoder: first decoder input (T5: pad)

    def __post_init__(self) -> None:
        _choice("arch", self.arch, ARCHS)
        _choice("norm", self.norm, NORMS)
        _choice("norm_position", self.norm_position, NORM_POSITIONS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("position", self.position, POSITIONS)
        _choice("attn_scale", self.attn_scale, ATTN_SCALES)
        _choice("init", self.init, INITS)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("parametrization", self.parametrization, PARAMETRIZATIONS)
        for name in (
            "vocab_size",
            "d_model",
            "n_layer",
            "n_head",
            "max_seq_len",
            "relative_num_buckets",
            "relative_max_distance",
            "mup_base_width",
        ):
            _positive(name, getattr(self, name))

        if self.head_dim is None:
            if self.d_model % self.n_head:
                raise InputError(
                    f"ModelConfig.d_model ({self.d_model}) must be divisible by ModelConfig.n_head ({self.n_head}), "
                    "or set ModelConfig.head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_head
        _positive("head_dim", self.head_dim)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        _positive("n_kv_head", self.n_kv_head)
        if self.n_head % self.n_kv_head:
            raise InputError(
                f"ModelConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        _positive("d_ff", self.d_ff)
        if self.n_decoder_layer is None:
            self.n_decoder_layer = self.n_layer
        _positive("n_decoder_layer", self.n_decoder_layer)

        if self.position == "rope" and self.head_dim % 2:
            raise InputError(f"ModelConfig.head_dim must be even for position='rope', got {self.head_dim}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise InputError(
                f"ModelConfig.d_model must be even for position='sinusoidal', got {self.d_model}"
            )
        if self.rope_theta <= 0:
            raise InputError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if isinstance(self.rope_scaling, dict):  # a saved (asdict) config, or keyword arguments
            unknown = sorted(set(self.rope_scaling) - {f.name for f in fields(RopeScaling)})
            if unknown:
                raise InputError(
                    f"ModelConfig.rope_scaling has unknown keys {unknown}; valid: "
                    f"{[f.name for f in fields(RopeScaling)]}"
                )
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        elif self.rope_scaling is not None:  # its own copy: resolve() fills defaults in
            self.rope_scaling = dataclasses.replace(self.rope_scaling)
        if self.rope_scaling is not None:
            if self.position != "rope":
                raise InputError(
                    f"ModelConfig.rope_scaling scales rotary positions, but position={self.position!r}; set "
                    "position=rope or remove rope_scaling"
                )
            self.rope_scaling.resolve(self.max_seq_len)
        if self.relative_num_buckets < 4:
            raise InputError(
                f"ModelConfig.relative_num_buckets must be >= 4, got {self.relative_num_buckets}"
            )
        if self.norm == "rmsnorm" and self.norm_bias:
            raise InputError("ModelConfig.norm_bias must be False with norm='rmsnorm' (RMSNorm has no bias)")
        if self.norm_eps <= 0:
            raise InputError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.type_vocab_size < 0:
            raise InputError(f"ModelConfig.type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.arch == "decoder" and (self.pooler or self.type_vocab_size):
            raise InputError(
                "ModelConfig.pooler / type_vocab_size are for arch 'encoder' or 'encoder-decoder'"
            )
        if not self.lm_head and (self.mlm_head_transform or self.lm_head_bias or self.arch != "encoder"):
            raise InputError(
                "ModelConfig.lm_head=False (backbone only) needs arch='encoder', mlm_head_transform=False "
                "and lm_head_bias=False"
            )
        _probability("dropout", self.dropout)
        _probability("attn_dropout", self.attn_dropout)
        self._check_attention()
        if self.init_std <= 0:
            raise InputError(f"ModelConfig.init_std must be > 0, got {self.init_std}")
        if self.logit_scale <= 0:
            raise InputError(f"ModelConfig.logit_scale must be > 0, got {self.logit_scale}")
        if isinstance(self.mup_attn_multiplier, bool) or not self.mup_attn_multiplier > 0:
            raise InputError(f"ModelConfig.mup_attn_multiplier must be > 0, got {self.mup_attn_multiplier!r}")
        if self.mup_attn_multiplier != 1.0 and (self.parametrization, self.attn_scale) != ("mup", "default"):
            raise InputError(
                "ModelConfig.mup_attn_multiplier scales muP's attention q k^T / d_h: it needs parametrization='mup' "
                f"and attn_scale='default' (got {self.parametrization!r}, {self.attn_scale!r}); remove it"
            )

    def _check_attention(self) -> None:
        """Sparse pattern fields must fit max_seq_len and the block layout."""
        n = self.max_seq_len
        block = self.attention_block_size
        high = n if self.attention_random_blocks else 2**16  # random blocks need whole blocks in the sequence
        if (
            isinstance(block, bool)
            or not isinstance(block, int)
            or not 16 <= block <= high
            or block & (block - 1)
        ):
            raise InputError(
                f"ModelConfig.attention_block_size must be a power of two in [16, {high}] (flex_attention "
                f"tiles{'; random blocks need block <= max_seq_len' if high == n else ''}), got {block!r}"
            )
        _in_range("attention_window", self.attention_window, 0, n, "0 = off, at most max_seq_len")
        _in_range("attention_global_tokens", self.attention_global_tokens, 0, n - 1, "fewer than max_seq_len")
        n_blocks = -(-n // block)
        _in_range(
            "attention_random_blocks",
            self.attention_random_blocks,
            0,
            n_blocks - 1,
            f"fewer than the {n_blocks} key blocks of max_seq_len / attention_block_size",
        )
        _in_range("attention_seed", self.attention_seed, 0, 2**63 - 1, "a generator seed")
        if self.attention_global_token_ids and self.arch == "decoder":
            raise InputError(
                "ModelConfig.attention_global_token_ids must be empty for arch='decoder' (it applies to "
                "encoders); decoders use attention_global_tokens"
            )
        for token in self.attention_global_token_ids:
            _in_range("attention_global_token_ids", token, 0, self.vocab_size - 1, "token ids < vocab_size")
        self._check_layer_pattern()

    def _check_layer_pattern(self) -> None:
        """Global every k layers: k fits the stacks; local layers have a window within max_seq_len (and only
        they do); local_rope_theta needs RoPE and local layers."""
        deepest = max(self.n_layer, self.n_decoder_layer or 0)
        k = self.global_attn_every_n_layers
        _in_range(
            "global_attn_every_n_layers", k, 1, deepest, f"the pattern repeats within the {deepest} layers"
        )
        window = self.local_attention_window
        if k == 1:
            if window or self.local_rope_theta is not None:
                raise InputError(
                    "ModelConfig.local_attention_window / local_rope_theta apply to local layers, and "
                    "global_attn_every_n_layers=1 makes every layer global; set global_attn_every_n_layers > 1 "
                    "(ModernBERT: 3) or remove them (local_attention_window=0, local_rope_theta=null)"
                )
            return
        _in_range(
            "local_attention_window",
            window,
            1,
            self.max_seq_len,
            f"the window of the local layers of global_attn_every_n_layers={k}, at most max_seq_len",
        )
        if self.local_rope_theta is not None:
            if self.position != "rope":
                raise InputError(
                    f"ModelConfig.local_rope_theta needs position='rope', got {self.position!r}; remove it"
                )
            if not self.local_rope_theta > 0:
                raise InputError(f"ModelConfig.local_rope_theta must be > 0, got {self.local_rope_theta!r}")
        elif self.position == "rope":
            self.local_rope_theta = self.rope_theta

    @property
    def sizes(self) -> Sizes:
        """``head_dim``, ``n_kv_head``, ``d_ff`` and ``n_decoder_layer`` typed ``int``: ``None`` (derive) only until
        ``__post_init__`` fills them in."""
        head_dim, n_kv, d_ff, n_dec = self.head_dim, self.n_kv_head, self.d_ff, self.n_decoder_layer
        if head_dim is None or n_kv is None or d_ff is None or n_dec is None:
            raise ValueError(
                "ModelConfig.head_dim / n_kv_head / d_ff / n_decoder_layer was set to None after construction; "
                "derive it again with dataclasses.replace(config, field=None)"
            )
        return Sizes(head_dim, n_kv, d_ff, n_dec)

    def local_layer(self, i: int) -> bool:
        """True when layer i of a stack attends locally (i % global_attn_every_n_layers != 0)."""
        return i % self.global_attn_every_n_layers != 0

    @classmethod
    def identity(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The fields of a (resolved, ``asdict``) config that identify the weights: all but ``RUN_TIME``."""
        return {f.name: config.get(f.name) for f in fields(cls) if f.name not in cls.RUN_TIME}

    @property
    def sparse(self) -> bool:
        """True when a sliding window, global tokens or random blocks restrict attention."""
        return bool(
            self.attention_window
            or self.attention_global_tokens
            or self.attention_global_token_ids
            or self.attention_random_blocks
        )

    @property
    def width_mult(self) -> float:
        """muP width multiplier m = d_model / mup_base_width (1 under standard parametrization)."""
        return self.d_model / self.mup_base_width if self.parametrization == "mup" else 1.0

    @property
    def gated(self) -> bool:
        """True for GLU-style MLPs: act(x W_gate) * (x W_up)."""
        return self.activation in GATED_ACTIVATIONS
