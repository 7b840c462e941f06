"""The recurrent baselines' hyper-parameters (``pretrain.models.rnn``) as typed, validated dataclasses: no torch,
so a baseline recipe is checked before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.errors import InputError

CELL_NAMES = ("lstm", "gru")
SCORES = ("dot", "multiplicative", "low_rank", "additive")


def _choice(owner: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"{owner}.{name} must be one of {list(allowed)}, got {value!r}")


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _dropout(owner: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise InputError(f"{owner}.dropout must be in [0, 1), got {value!r}")


@dataclass
class RNNConfig:
    """Hyper-parameters of :class:`RNNLanguageModel`."""

    cell: str = "lstm"  # lstm | gru
    vocab_size: int = 1024
    d_embed: int = 256
    d_hidden: int = 256
    n_layer: int = 2
    dropout: float = 0.2  # embedding output, between layers, before the output layer
    tie_embeddings: bool = True
    forget_bias: float = 1.0  # LSTM forget gate (GRU: update gate) bias at initialisation
    init_range: float = 0.1  # embeddings (and an untied output layer) ~ U(-init_range, init_range)
    pad_token_id: int | None = None  # for decoding (pretrain.models.generation)
    eos_token_id: int | None = None

    @property
    def arch(self) -> str:
        return "decoder"

    @property
    def lm_head(self) -> bool:
        return True

    def __post_init__(self) -> None:
        _choice("RNNConfig", "cell", self.cell, CELL_NAMES)
        _positive(
            "RNNConfig",
            vocab_size=self.vocab_size,
            d_embed=self.d_embed,
            d_hidden=self.d_hidden,
            n_layer=self.n_layer,
        )
        _dropout("RNNConfig", self.dropout)
        if self.forget_bias < 0:
            raise InputError(f"RNNConfig.forget_bias should be >= 0 (1.0 is usual), got {self.forget_bias}")


@dataclass
class Seq2SeqConfig:
    """Hyper-parameters of :class:`Seq2SeqRNN` (one vocabulary shared by source and target)."""

    cell: str = "lstm"
    vocab_size: int = 1024
    d_embed: int = 256
    d_hidden: int = 256
    n_layer: int = 1
    bidirectional: bool = True  # encoder
    attention: str = "multiplicative"  # dot | multiplicative | low_rank | additive
    attention_rank: int = 32  # r of low_rank
    d_attention: int | None = None  # A of additive (default d_hidden)
    dropout: float = 0.2
    tie_embeddings: bool = True  # output layer weight = target embedding (needs d_embed == d_hidden)
    forget_bias: float = 1.0
    pad_token_id: int = 0
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None  # first decoder input (BOS)

    @property
    def arch(self) -> str:
        return "encoder-decoder"

    @property
    def lm_head(self) -> bool:
        return True

    @property
    def d_memory(self) -> int:
        return self.d_hidden * (2 if self.bidirectional else 1)

    def __post_init__(self) -> None:
        _choice("Seq2SeqConfig", "cell", self.cell, CELL_NAMES)
        _choice("Seq2SeqConfig", "attention", self.attention, SCORES)
        if self.d_attention is None:
            self.d_attention = self.d_hidden
        _positive(
            "Seq2SeqConfig",
            vocab_size=self.vocab_size,
            d_embed=self.d_embed,
            d_hidden=self.d_hidden,
            n_layer=self.n_layer,
            attention_rank=self.attention_rank,
            d_attention=self.d_attention,
        )
        _dropout("Seq2SeqConfig", self.dropout)
        if self.attention == "dot" and self.d_memory != self.d_hidden:
            raise InputError(
                f"Seq2SeqConfig.attention='dot' needs encoder outputs of the decoder's width ({self.d_hidden}), got "
                f"{self.d_memory} (bidirectional); set bidirectional=false or use attention='multiplicative'"
            )
        if self.tie_embeddings and self.d_embed != self.d_hidden:
            raise InputError(
                f"Seq2SeqConfig.tie_embeddings needs d_embed == d_hidden, got {self.d_embed} != {self.d_hidden}"
            )
