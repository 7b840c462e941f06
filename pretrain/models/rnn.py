"""Recurrent baselines: a stacked LSTM/GRU language model and an RNN encoder-decoder with attention.

Axes: B batch, T target (decoder) length, S source length, V vocabulary, E embedding width, H hidden width,
M memory width (encoder outputs: 2H bidirectional, else H), L layers.

Both models follow the backbone's calling convention (``pretrain.models.transformer.Transformer``): keyword inputs named as
the objectives' batches, an output with ``.logits``, and a ``cache`` that carries the past -- for an RNN an
:class:`RNNState` (hidden states, LSTM cells, and the encoder memory for the encoder-decoder), updated in place
and reordered by ``RNNState.reorder`` as ``pretrain.models.beam_search`` reorders a KV cache. So
``pretrain.models.generation.generate`` and ``pretrain.models.beam_search.beam_search`` decode them unchanged, and
truncated BPTT is ``cache=out.cache.detach()`` between batches.

Language model (Zaremba et al. 2014; Merity et al. 2018): embedding -> dropout -> L-layer LSTM/GRU (dropout
between layers) -> [projection H -> E when tied and H != E] -> dropout -> linear to V, whose weight is the
input embedding when ``tie_embeddings`` (Press & Wolf 2017; Inan et al. 2017). The LSTM forget-gate bias
starts at ``forget_bias`` > 0 (Gers et al. 2000; Jozefowicz et al. 2015); for the GRU the same bias goes to
the update gate z (h' = (1 - z) n + z h), its "keep the past" gate.

Encoder-decoder (Luong et al. 2015 global attention; Bahdanau et al. 2015 additive score): a bidirectional
encoder gives memory s_1..s_S; its final states, through a tanh bridge, start the decoder. Each decoder output
h_t scores every s_j, ``a_t = softmax_j score(h_t, s_j)`` over real source tokens, ``c_t = sum_j a_tj s_j``,
``h~_t = tanh(W_c [c_t; h_t])``, logits = ``W_o h~_t``. Scores:

    dot             h_t . s_j                          (needs M = H)
    multiplicative  h_t^T W s_j                        W (H, M)
    low_rank        (U h_t) . (V s_j)                  U (r, H), V (r, M): W = U^T V of rank r
    additive        v^T tanh(W_1 h_t + W_2 s_j)        W_1 (A, H), W_2 (A, M), v (A,)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from pretrain.models.rnn_config import RNNConfig, Seq2SeqConfig

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU}


def init_recurrent(rnn: nn.LSTM | nn.GRU, forget_bias: float) -> None:
    """PyTorch's U(-1/sqrt(H), 1/sqrt(H)) weights; the forget (LSTM, gate order i f g o) or update (GRU, r z n)
    gate bias set to ``forget_bias`` (input-side bias; the hidden-side one zeroed so the sum is exact)."""
    H = rnn.hidden_size
    for name, p in rnn.named_parameters():
        if name.startswith("bias_"):
            with torch.no_grad():
                p[H : 2 * H] = forget_bias if name.startswith("bias_ih") else 0.0


def _detached(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.detach()


@dataclass
class RNNState:
    """The past of a recurrent model: hidden states ``h`` (L, B, H), LSTM cells ``c`` (L, B, H) (None for the
    GRU) and, for the encoder-decoder, the encoder ``memory`` (B, S, M), its attention ``keys`` and the source
    ``encoder_mask`` (B, S). Updated in place by the model (decoding loops reuse the object they passed)."""

    h: Tensor
    c: Tensor | None = None
    memory: Tensor | None = None
    keys: Tensor | None = None
    encoder_mask: Tensor | None = None

    @property
    def rnn_state(self) -> Tensor | tuple[Tensor, Tensor]:
        """``nn.LSTM`` / ``nn.GRU`` layout: ``(h, c)`` or ``h``."""
        return self.h if self.c is None else (self.h, self.c)

    def update(self, state: Tensor | tuple[Tensor, Tensor]) -> RNNState:
        self.h, self.c = state if isinstance(state, tuple) else (state, None)
        return self

    def detach(self) -> RNNState:
        """The same state cut from the graph (truncated backpropagation through time)."""
        return replace(
            self,
            h=self.h.detach(),
            c=_detached(self.c),
            memory=_detached(self.memory),
            keys=_detached(self.keys),
        )

    def reorder(self, index: Tensor, beams_only: bool = False) -> None:
        """Keep batch rows ``index`` (B',) in place (beam reordering / expansion); ``beams_only``: ``index`` only
        permutes the beams of each input, which share the encoder side (as ``KVCache.reorder``)."""
        self.h = self.h.index_select(1, index)
        self.c = None if self.c is None else self.c.index_select(1, index)
        if beams_only:
            return
        for name in ("memory", "keys", "encoder_mask"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, index))


def at_positions(x: Tensor, positions: Tensor | None) -> Tensor:
    """x (B, T, d) -> the rows at flat positions (N,) -> (N, d); x itself when positions is None."""
    return x if positions is None else x.flatten(0, 1)[positions]


@dataclass
class RNNOutput:
    logits: Tensor  # (B, T, V)
    hidden_states: Tensor  # (B, T, H or E) the input of the output layer
    cache: RNNState | None = None
    attention: Tensor | None = None  # (B, T, S) encoder-decoder attention weights


class RNNLanguageModel(nn.Module):
    """Stacked LSTM/GRU language model (see module doc)."""

    def __init__(self, config: RNNConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_embed)
        self.rnn = CELLS[c.cell](
            c.d_embed,
            c.d_hidden,
            num_layers=c.n_layer,
            dropout=c.dropout if c.n_layer > 1 else 0.0,
            batch_first=True,
        )
        tied_projection = c.tie_embeddings and c.d_hidden != c.d_embed
        self.proj = nn.Linear(c.d_hidden, c.d_embed, bias=False) if tied_projection else None
        self.head = nn.Linear(c.d_embed if c.tie_embeddings else c.d_hidden, c.vocab_size)
        self.drop = nn.Dropout(c.dropout)
        nn.init.uniform_(self.embed.weight, -c.init_range, c.init_range)
        nn.init.zeros_(self.head.bias)
        if c.tie_embeddings:
            self.head.weight = self.embed.weight
        else:
            nn.init.uniform_(self.head.weight, -c.init_range, c.init_range)
        init_recurrent(self.rnn, c.forget_bias)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: RNNState | None = None,
        use_cache: bool = True,
        target_positions: Tensor | None = None,
    ) -> RNNOutput:
        """``input_ids (B, T)`` continuing the state in ``cache`` (None: zeros) -> logits (B, T, V) and the state
        after the last token. ``attention_mask`` must be all ones (packed streams); positions are implicit.
        ``target_positions`` (N,): logits at these flat (B * T) positions only, (N, V), as the transformer's."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "RNNLanguageModel reads packed streams without padding; attention_mask must be all 1"
            )
        out, state = self.rnn(self.drop(self.embed(input_ids)), None if cache is None else cache.rnn_state)
        if self.proj is not None:
            out = self.proj(out)
        out = self.drop(out)
        if use_cache:
            cache = (cache or RNNState(input_ids.new_empty(0))).update(state)
        return RNNOutput(self.head(at_positions(out, target_positions)), out, cache if use_cache else None)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied head is counted once
        return n - self.embed.weight.numel() if exclude_embeddings else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 x the multiply-accumulate weights (recurrent matrices,
        projection, output layer); the embedding lookup is free. ``seq_len`` does not matter for an RNN."""
        matrices = [p for n, p in self.rnn.named_parameters() if n.startswith("weight_")]
        matrices += [self.head.weight] + ([self.proj.weight] if self.proj is not None else [])
        return 6.0 * sum(p.numel() for p in matrices)


class AttentionScore(nn.Module):
    """score(h_t, s_j) for every decoder output and source position (see module doc)."""

    def __init__(self, kind: str, d_query: int, d_key: int, rank: int, d_attention: int):
        super().__init__()
        self.kind = kind
        self.query: nn.Linear | None = None
        self.key: nn.Linear | None = None
        self.v: nn.Linear | None = None
        if kind == "multiplicative":
            self.query = nn.Linear(d_query, d_key, bias=False)  # q = W^T h: q . s = h^T W s
        elif kind == "low_rank":
            self.query, self.key = nn.Linear(d_query, rank, bias=False), nn.Linear(d_key, rank, bias=False)
        elif kind == "additive":
            self.query = nn.Linear(d_query, d_attention, bias=False)
            self.key = nn.Linear(d_key, d_attention, bias=True)
            self.v = nn.Linear(d_attention, 1, bias=False)

    def project_keys(self, memory: Tensor) -> Tensor:
        """Per-source work done once per sequence: (B, S, M) -> (B, S, r | A | M)."""
        return memory if self.key is None else self.key(memory)

    def forward(self, h: Tensor, keys: Tensor) -> Tensor:
        """h (B, T, H), projected keys (B, S, *) -> scores (B, T, S)."""
        q = h if self.query is None else self.query(h)
        if self.v is not None:  # additive
            return self.v(torch.tanh(q[:, :, None] + keys[:, None])).squeeze(-1)
        return q @ keys.transpose(1, 2)


class Seq2SeqRNN(nn.Module):
    """RNN encoder-decoder with attention (see module doc)."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_embed, padding_idx=c.pad_token_id)  # source and target
        rnn = CELLS[c.cell]
        between = c.dropout if c.n_layer > 1 else 0.0
        self.encoder = rnn(
            c.d_embed, c.d_hidden, c.n_layer, batch_first=True, dropout=between, bidirectional=c.bidirectional
        )
        self.decoder = rnn(c.d_embed, c.d_hidden, c.n_layer, batch_first=True, dropout=between)
        directions = 2 if c.bidirectional else 1
        self.bridge_h = nn.Linear(directions * c.d_hidden, c.d_hidden)
        self.bridge_c = nn.Linear(directions * c.d_hidden, c.d_hidden) if c.cell == "lstm" else None
        self.score = AttentionScore(
            c.attention, c.d_hidden, c.d_memory, c.attention_rank, c.d_attention or c.d_hidden
        )
        self.combine = nn.Linear(c.d_memory + c.d_hidden, c.d_hidden, bias=False)  # W_c
        self.head = nn.Linear(c.d_hidden, c.vocab_size)
        if c.tie_embeddings:
            self.head.weight = self.embed.weight
        self.drop = nn.Dropout(c.dropout)
        for module in (self.encoder, self.decoder):
            init_recurrent(module, c.forget_bias)

    def _bridge(self, final: Tensor, layer: nn.Linear) -> Tensor:
        """Encoder final states (L * dirs, B, H) -> decoder initial states (L, B, H)."""
        L, dirs = self.config.n_layer, 2 if self.config.bidirectional else 1
        final = final.view(L, dirs, *final.shape[1:]).permute(0, 2, 1, 3).flatten(2)  # (L, B, dirs * H)
        return torch.tanh(layer(final))

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> RNNState:
        """Source (B, S) -> a cache with the memory, its key projection, the mask and the decoder's first state."""
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_token_id
        lengths = attention_mask.sum(1)
        if bool((lengths == 0).any()):
            raise ValueError(
                "every source sequence needs at least one token (attention_mask has an empty row)"
            )
        packed = pack_padded_sequence(
            self.drop(self.embed(input_ids)), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        memory, final = self.encoder(packed)
        memory, _ = pad_packed_sequence(
            memory, batch_first=True, total_length=input_ids.shape[1]
        )  # (B, S, M)
        h, c = final if isinstance(final, tuple) else (final, None)
        return RNNState(
            self._bridge(h, self.bridge_h),
            None if c is None or self.bridge_c is None else self._bridge(c, self.bridge_c),
            memory,
            self.score.project_keys(memory),
            attention_mask.bool(),
        )

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: RNNState | None = None,
        use_cache: bool = False,
        target_positions: Tensor | None = None,
    ) -> RNNOutput:
        """Source ``input_ids (B, S)`` (or a ``cache`` from an earlier call) and decoder inputs (B, T) -> logits
        (B, T, V), attention weights (B, T, S) and, with ``use_cache``, the cache after the last target token.
        Padded target positions (``decoder_attention_mask`` 0) yield logits that the loss ignores;
        ``target_positions`` (N,) limits the logits to those flat (B * T) positions, (N, V)."""
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids (B, T) are required (teacher forcing or the decoding prefix)")
        if cache is None:
            if input_ids is None:
                raise ValueError("pass the source input_ids (B, S) or a cache from encode()")
            cache = self.encode(input_ids, attention_mask)
        memory, keys = cache.memory, cache.keys
        assert cache.encoder_mask is not None  # encode()'s
        out, state = self.decoder(self.drop(self.embed(decoder_input_ids)), cache.rnn_state)  # (B, T, H)
        scores = self.score(out, keys).masked_fill(
            ~cache.encoder_mask[:, None, :], float("-inf")
        )  # (B, T, S)
        weights = scores.softmax(-1)
        context = weights @ memory  # (B, T, M)
        attentional = self.drop(torch.tanh(self.combine(torch.cat([context, out], -1))))  # (B, T, H)
        if use_cache:
            cache.update(state)
        logits = self.head(at_positions(attentional, target_positions))
        return RNNOutput(logits, attentional, cache if use_cache else None, weights)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n


def matched_width(target_params: int, config: RNNConfig) -> int:
    """The width w (d_embed = d_hidden = w) whose language model's parameter count is closest to
    ``target_params`` (other fields from ``config``): for comparisons at equal size."""

    def count(width: int) -> int:
        with torch.device("meta"):
            return RNNLanguageModel(
                RNNConfig(**{**config.__dict__, "d_embed": width, "d_hidden": width})
            ).num_params()

    lo, hi = 1, 1
    while count(hi) < target_params:
        hi *= 2
    while lo < hi:  # smallest width reaching the target (the count grows with the width)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target_params else (lo, mid)
    return min((max(lo - 1, 1), lo), key=lambda w: abs(count(w) - target_params))
