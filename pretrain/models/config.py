"""Architecture as data: one typed, validated dataclass describes GPT, BERT, T5 and Llama style transformers.

Every option is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field, the allowed
values and the value given. ``None`` fields are resolved to their defaults there (``n_kv_head = n_head``,
``head_dim = d_model // n_head``, ``d_ff = 4 * d_model``, ``n_decoder_layer = n_layer``), so a resolved config
round-trips through ``dataclasses.asdict`` and OmegaConf structured configs.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("decoder", "encoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh", "reglu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "reglu")
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "none")
ATTN_SCALES = ("default", "none")
INITS = ("gpt2", "t5", "bert")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ModelConfig.{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {value!r}")


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`pretrain.models.transformer.Transformer`.

    Shapes: ``d_model`` = d, ``n_head`` = h query heads of ``head_dim`` = d_h, ``n_kv_head`` = g key/value heads
    (grouped-query attention when g < h), ``d_ff`` = MLP width (per branch for gated activations).
    """

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

    activation: str = "gelu_tanh"  # relu | gelu | gelu_tanh | swiglu | geglu | geglu_tanh | reglu
    mlp_bias: bool = True
    attn_bias: bool = True
    attn_scale: str = "default"  # default: softmax(q k^T / sqrt(d_h)) | none: softmax(q k^T) (T5)

    position: str = "learned"  # learned | sinusoidal | rope | relative (T5 buckets) | none
    rope_theta: float = 10000.0
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    type_vocab_size: int = 0  # BERT segment embeddings; 0 = none

    tie_embeddings: bool = True  # LM head weight = token embedding
    lm_head: bool = True  # False: backbone only (logits None), e.g. BertModel
    lm_head_bias: bool = False  # per-token output bias (BERT)
    logit_scale: float = 1.0  # multiplies the final hidden states before the LM head (T5 v1.0: d**-0.5)
    mlm_head_transform: bool = False  # BERT MLM head: dense + activation + norm before the LM head
    pooler: bool = False  # BERT pooler: tanh(dense(first token))

    dropout: float = 0.0  # embeddings and every residual branch
    attn_dropout: float = 0.0  # attention probabilities

    init: str = "gpt2"  # gpt2 (N(0, std), residual projections std/sqrt(2L)) | bert (N(0, std)) | t5 (fan-in)
    init_std: float = 0.02

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
        for name in (
            "vocab_size",
            "d_model",
            "n_layer",
            "n_head",
            "max_seq_len",
            "relative_num_buckets",
            "relative_max_distance",
        ):
            _positive(name, getattr(self, name))

        if self.head_dim is None:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"ModelConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}), "
                    "or set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_head
        _positive("head_dim", self.head_dim)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        _positive("n_kv_head", self.n_kv_head)
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"ModelConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        _positive("d_ff", self.d_ff)
        if self.n_decoder_layer is None:
            self.n_decoder_layer = self.n_layer
        _positive("n_decoder_layer", self.n_decoder_layer)

        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for position='rope', got {self.head_dim}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(
                f"ModelConfig.d_model must be even for position='sinusoidal', got {self.d_model}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.relative_num_buckets < 4:
            raise ValueError(
                f"ModelConfig.relative_num_buckets must be >= 4, got {self.relative_num_buckets}"
            )
        if self.norm == "rmsnorm" and self.norm_bias:
            raise ValueError("ModelConfig.norm_bias must be False with norm='rmsnorm' (RMSNorm has no bias)")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.type_vocab_size < 0:
            raise ValueError(f"ModelConfig.type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.arch == "decoder" and (self.pooler or self.type_vocab_size):
            raise ValueError(
                "ModelConfig.pooler / type_vocab_size are for arch 'encoder' or 'encoder-decoder'"
            )
        if not self.lm_head and (self.mlm_head_transform or self.lm_head_bias or self.arch != "encoder"):
            raise ValueError(
                "ModelConfig.lm_head=False (backbone only) needs arch='encoder', mlm_head_transform=False "
                "and lm_head_bias=False"
            )
        _probability("dropout", self.dropout)
        _probability("attn_dropout", self.attn_dropout)
        if self.init_std <= 0:
            raise ValueError(f"ModelConfig.init_std must be > 0, got {self.init_std}")
        if self.logit_scale <= 0:
            raise ValueError(f"ModelConfig.logit_scale must be > 0, got {self.logit_scale}")

    @property
    def gated(self) -> bool:
        """True for GLU-style MLPs: act(x W_gate) * (x W_up)."""
        return self.activation in GATED_ACTIVATIONS
