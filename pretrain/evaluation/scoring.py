"""Batched log-likelihood scoring and greedy decoding, with lm-evaluation-harness's semantics.

``LMScorer`` sees a model only through ``logits_fn``:

- decoder-only: ``logits_fn(input_ids (B, T), attention_mask (B, T)) -> logits (B, T, V)``;
- encoder-decoder: ``logits_fn(input_ids (B, S), attention_mask (B, S), decoder_input_ids (B, T),
  decoder_attention_mask (B, T)) -> decoder logits (B, T, V)``;
- encoder-only: ``logits_fn(input_ids (B, T), attention_mask (B, T)) -> MLM logits (B, T, V)`` (right padded).

Tokenization follows lm-eval's ``TemplateLM._encode_pair``: trailing whitespace of the context moves to
the continuation; decoder-only models encode ``context`` and ``context + continuation`` and take the
continuation as ``whole[len(context_ids):]``; encoder-decoder models encode both separately (the
continuation without special tokens) and score it as targets given the context as encoder input.
An empty context is replaced by ``prefix_token_id`` (BOS, else EOS).

Decoder-only scoring (lm-eval's ``_loglikelihood_tokens``): the model reads
``(context + continuation)[-(max_length + 1):][:-1]`` and the continuation's log-probabilities are read at
the last ``len(continuation)`` positions::

    tokens  c0 c1 c2 | x0 x1 x2
    input   c0 c1 c2   x0 x1        (last token dropped)
    scores        x0   x1 x2        (log p(x_i | everything before))

The log-likelihood is the sum of those log-probabilities (log-softmax in float64), ``is_greedy`` whether
every continuation token is the argmax. Requests are sorted by length and batched; padding (right or left,
with position ids rebuilt from the attention mask by the model adapter) never changes a request's result.

Encoder-only (BERT-style) scoring is the pseudo-log-likelihood (Salazar et al., "Masked Language Model
Scoring", ACL 2020): the model reads ``[CLS] + (context + continuation)[-(max_length - 2):] + [SEP]`` (the
layout MLM pretraining used) once per continuation token, that token replaced by ``[MASK]``, and
``PLL = sum_i log p(x_i | everything else)``; ``is_greedy`` whether each masked token is the argmax. Every
masked row is one batch row, so a request of c tokens costs c rows.

Too long requests are cut from the left, keeping the whole continuation -- lm-eval 0.4.13's rule
(``HFLM._loglikelihood_tokens``: ``(context_enc + continuation_enc)[-(self.max_length + 1):][:-1]`` for
causal models, the encoder input ``context_enc[-self.max_length:]`` for seq2seq ones); ``truncated``
counts the requests that lose context tokens, so a report can say how many prompts did not fit.

Unpadded scoring (``packed_logits_fn``, which our backbone provides: ``models.transformer_packed_logits_fn``): the
requests of a batch are packed into rows without padding, kept apart by document ids
(``pretrain.datamodules.unpadded``; a seq2seq request's encoder and decoder share a row), and a batch takes
requests in the same longest-first order until they fill ``batch_size`` rows as long as its longest request. Every
request's log-likelihood is the padded path's (tested to 1e-6); only padding is no longer computed, and short
requests share a forward pass. ``packed_logits_fn(input_ids, document_ids, position_ids)`` -> logits (R, C, V)
(decoder, encoder); encoder-decoder: ``(input_ids, document_ids, position_ids, decoder_input_ids,
decoder_document_ids, decoder_position_ids)``.

Greedy decoding (``greedy_until``) runs on left-padded prompts through ``decode_fn`` (a generator that
yields next-token logits and is sent the chosen ids; ``models.transformer_decode_fn`` uses the KV cache),
or, without one, re-reads the whole sequence with ``logits_fn`` at every step. It stops at EOS, at a stop
sequence (the text is cut before it, as lm-eval does) or after ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from pretrain.errors import InputError

LogitsFn = Callable[..., torch.Tensor]
DecodeSteps = Generator[torch.Tensor, torch.Tensor, None]
# (prompt ids (B, T) left-padded | encoder ids (B, S), mask) -> generator: yields next-token logits (B, V),
# is sent the chosen ids (B,)
DecodeFn = Callable[[torch.Tensor, torch.Tensor], DecodeSteps]
ARCHITECTURES = ("decoder", "encoder-decoder", "encoder")
Request = tuple[list[int], list[int]]  # (context ids, continuation ids)
ScoreFn = Callable[[Sequence[Request]], list[tuple[float, bool]]]  # LMScorer.loglikelihood_tokens


class UnsupportedModelError(ValueError):
    """The model cannot be evaluated this way (e.g. greedy generation from an encoder-only BERT)."""


def check_architecture(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unknown architecture {arch!r}; supported: {list(ARCHITECTURES)}")


@dataclass
class LMScorer:
    """Log-likelihoods of continuations and greedy generations from a model's logits."""

    logits_fn: LogitsFn
    tokenizer: Tokenizer
    max_length: int
    prefix_token_id: int
    eos_token_id: int | None = None
    arch: str = "decoder"
    decoder_start_token_id: int | None = None
    pad_token_id: int = 0
    batch_size: int = 16
    padding_side: str = "right"
    device: torch.device | str = "cpu"
    decode_fn: DecodeFn | None = None  # incremental decoding (KV cache); default: re-run logits_fn per step
    mask_token_id: int | None = None  # encoder-only: [MASK], [CLS], [SEP] of the pseudo-log-likelihood
    cls_token_id: int | None = None
    sep_token_id: int | None = None
    packed_logits_fn: LogitsFn | None = None  # unpadded scoring (module docstring); None: padded batches

    def __post_init__(self) -> None:
        check_architecture(self.arch)
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.arch == "encoder-decoder" and self.decoder_start_token_id is None:
            raise ValueError("an encoder-decoder scorer needs decoder_start_token_id (T5: the pad id, 0)")
        if self.encoder_only:
            if None in (self.mask_token_id, self.cls_token_id, self.sep_token_id):
                raise ValueError("an encoder-only scorer needs mask_token_id, cls_token_id and sep_token_id")
            if self.max_length < 4:
                raise ValueError(f"an encoder-only scorer needs max_length >= 4, got {self.max_length}")

    @property
    def encoder_only(self) -> bool:
        return self.arch == "encoder"

    @property
    def window_length(self) -> int:
        """Tokens a rolling-perplexity window predicts at most: all the model reads, less [CLS], [SEP] and
        one context token for an encoder."""
        return self.max_length - 3 if self.encoder_only else self.max_length

    def truncated(self, requests: Sequence[Request]) -> int:
        """How many requests lose context tokens to the left truncation (see the module docstring)."""
        if self.seq2seq:
            return sum(len(ctx) > self.max_length for ctx, _ in requests)
        room = self.max_length - 2 if self.encoder_only else self.max_length + 1
        return sum(len(ctx) + len(cont) > room for ctx, cont in requests)

    @property
    def seq2seq(self) -> bool:
        return self.arch == "encoder-decoder"

    # ------------------------------------------------------------------ tokenization
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) exactly as lm-eval tokenizes a loglikelihood request."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if context == "":  # (lm-eval moves the spaces after this check, then fails on an empty context)
            cont = self.encode(continuation, add_special_tokens=False)
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        if self.seq2seq:
            return self.encode(context), self.encode(continuation, add_special_tokens=False)
        context_ids = self.encode(context)
        return context_ids, self.encode(context + continuation)[len(context_ids) :]

    # ------------------------------------------------------------------ log-likelihood
    def forward_count(self, requests: Sequence[Request]) -> int:
        """How many forward passes ``loglikelihood_tokens(requests)`` makes (batches of requests, or of masked rows
        for an encoder)."""
        if self.packed_logits_fn is not None and not self.seq2seq:
            if self.encoder_only:
                return len(self._chunks([len(s) for s in self._pll_rows(requests)[1]]))
            return len(self._chunks(sorted((self._sizes(r)[0] for r in requests), reverse=True)))
        rows = sum(len(cont) for _, cont in requests) if self.encoder_only else len(requests)
        return -(-rows // self.batch_size)

    def encode_requests(self, pairs: Sequence[tuple[str, str]]) -> list[Request]:
        """Token requests of (context, continuation) string pairs; an error names a continuation with no
        tokens of its own."""
        encoded = [self.encode_pair(c, x) for c, x in pairs]
        for (ctx, cont), (_, cont_ids) in zip(pairs, encoded):
            if not cont_ids:
                raise InputError(
                    f"continuation {cont!r} after context ending {ctx[-40:]!r} encodes to no tokens "
                    "of its own (it merged into the context's last token); separate them with a delimiter"
                )
        return encoded

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), is_greedy) per (context, continuation) string pair."""
        return self.loglikelihood_tokens(self.encode_requests(pairs))

    def loglikelihood_tokens(
        self, requests: Sequence[tuple[list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        """Token-level version of ``loglikelihood``; results are in the order of ``requests``."""
        for i, (ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise InputError(f"request {i}: context and continuation must both be non-empty token lists")
            limit = self.max_length - 2 if self.encoder_only else self.max_length
            if len(cont) > limit:
                specials = " less [CLS] and [SEP]" if self.encoder_only else ""
                raise InputError(
                    f"request {i}: continuation of {len(cont)} tokens exceeds max_length={self.max_length}"
                    + specials
                )
        if self.encoder_only:
            return self._pseudo_loglikelihood(requests)
        # longest first (as lm-eval), so a batch's padding is small and memory peaks at the start
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if self.packed_logits_fn is not None and not self.seq2seq:
            chunks = [
                [order[j] for j in chunk]
                for chunk in self._chunks([self._sizes(requests[i])[0] for i in order])
            ]
        else:  # seq2seq packs each batch of batch_size requests
            chunks = [
                order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)
            ]
        for chunk in chunks:
            score = self._score_packed if self.packed_logits_fn is not None else self._score_batch
            for i, res in zip(chunk, score([requests[i] for i in chunk])):
                results[i] = res
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ unpadded (packed) scoring
    def _sizes(self, request: Request) -> tuple[int, ...]:
        """Tokens the model reads for a decoder-only request: (its row,)."""
        ctx, cont = request
        return (len((ctx + cont)[-(self.max_length + 1) :]) - 1,)

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """Consecutive runs of ``lengths`` (longest first) whose first-fit packing fills at most ``batch_size``
        rows as long as the run's first (longest) item: positions into ``lengths``."""
        chunks: list[list[int]] = []
        room: list[int] = []
        capacity = 0
        for j, n in enumerate(lengths):
            fit = next((r for r, left in enumerate(room) if n <= left), None)
            if fit is not None:
                room[fit] -= n
            else:
                if not room or len(room) == self.batch_size:  # a new batch, its rows as long as this item
                    chunks.append([])
                    room, capacity = [], n
                room.append(capacity - n)
            chunks[-1].append(j)
        return chunks

    @staticmethod
    def _required(token_id: int | None) -> int:
        """A special-token id ``__post_init__`` requires of this architecture."""
        assert token_id is not None, "checked by LMScorer.__post_init__"
        return token_id

    @torch.no_grad()
    def _score_packed(self, batch: list[Request]) -> list[tuple[float, bool]]:
        """``_score_batch`` on rows packed without padding (module docstring)."""
        from pretrain.datamodules.unpadded import first_and_last, first_fit, pack

        packed_logits_fn = self.packed_logits_fn
        assert packed_logits_fn is not None  # what chose this path
        conts = [cont for _, cont in batch]
        if self.seq2seq:
            encoder = [ctx[-self.max_length :] for ctx, _ in batch]
            decoder = [[self._required(self.decoder_start_token_id)] + cont[:-1] for cont in conts]
            widths = [max(map(len, encoder)), max(map(len, decoder))]
            rows = first_fit([[len(e), len(d)] for e, d in zip(encoder, decoder, strict=True)], widths)
            enc = pack(encoder, rows, widths[0], self.pad_token_id)
            dec = pack(decoder, rows, widths[1], self.pad_token_id)
            logits = packed_logits_fn(
                *(t.to(self.device) for t in (enc["tokens"], enc["document_ids"], enc["position_ids"])),
                *(t.to(self.device) for t in (dec["tokens"], dec["document_ids"], dec["position_ids"])),
            )
            first, _ = first_and_last(dec["example_ids"], len(batch))
            starts = first.tolist()
        else:
            seqs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in batch]
            rows = first_fit([[len(s)] for s in seqs], [max(map(len, seqs))])
            packed = pack(seqs, rows, max(map(len, seqs)), self.pad_token_id)
            logits = packed_logits_fn(
                *(
                    t.to(self.device)
                    for t in (packed["tokens"], packed["document_ids"], packed["position_ids"])
                )
            )
            _, last = first_and_last(packed["example_ids"], len(batch))
            starts = [end + 1 - len(cont) for end, cont in zip(last.tolist(), conts, strict=True)]
        flat = logits.flatten(0, 1)
        results = []
        for start, cont in zip(starts, conts, strict=True):
            logprobs = F.log_softmax(flat[start : start + len(cont)].double(), dim=-1)
            target = torch.tensor(cont, device=logprobs.device)
            ll = logprobs.gather(-1, target[:, None]).sum()
            results.append((float(ll), bool((logprobs.argmax(-1) == target).all())))
        return results

    def _pad(self, rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(ids (B, T), mask (B, T), offset of each row's first real token)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        offsets = []
        for b, row in enumerate(rows):
            off = width - len(row) if side == "left" else 0
            ids[b, off : off + len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, off : off + len(row)] = 1
            offsets.append(off)
        return ids.to(self.device), mask.to(self.device), offsets

    @torch.no_grad()
    def _score_batch(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        conts = [cont for _, cont in batch]
        if self.seq2seq:
            enc, enc_mask, _ = self._pad([ctx[-self.max_length :] for ctx, _ in batch], self.padding_side)
            dec_rows = [[self._required(self.decoder_start_token_id)] + cont[:-1] for cont in conts]
            dec, dec_mask, _ = self._pad(dec_rows, "right")  # causal decoder: right padding is inert
            logits = self.logits_fn(enc, enc_mask, dec, dec_mask)  # (B, T, V)
            spans = [(0, len(cont)) for cont in conts]
        else:
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in batch]
            ids, mask, offsets = self._pad(rows, self.padding_side)
            logits = self.logits_fn(ids, mask)  # (B, T, V)
            spans = [
                (off + len(row) - len(cont), off + len(row)) for off, row, cont in zip(offsets, rows, conts)
            ]
        results = []
        for b, ((lo, hi), cont) in enumerate(zip(spans, conts)):
            logprobs = F.log_softmax(logits[b, lo:hi].double(), dim=-1)  # (c, V), exact sums of many tokens
            target = torch.tensor(cont, device=logprobs.device)
            ll = logprobs.gather(-1, target[:, None]).sum()
            results.append((float(ll), bool((logprobs.argmax(-1) == target).all())))
        return results

    def _pll_rows(
        self, requests: Sequence[Request]
    ) -> tuple[list[tuple[int, int, list[int]]], list[list[int]]]:
        """The pseudo-log-likelihood's rows, longest first: ``(request, masked position, sequence)`` and each
        sequence with that position masked."""
        rows: list[tuple[int, int, list[int]]] = []  # (request, masked position, sequence)
        for r, (ctx, cont) in enumerate(requests):
            cls, sep = self._required(self.cls_token_id), self._required(self.sep_token_id)
            seq = [cls] + (ctx + cont)[-(self.max_length - 2) :] + [sep]
            rows += [(r, len(seq) - 1 - len(cont) + i, seq) for i in range(len(cont))]
        rows = [rows[i] for i in sorted(range(len(rows)), key=lambda i: -len(rows[i][2]))]
        mask = self._required(self.mask_token_id)
        return rows, [seq[:pos] + [mask] + seq[pos + 1 :] for _, pos, seq in rows]

    @torch.no_grad()
    def _pseudo_loglikelihood(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """Encoder-only: one masked row per continuation token (Salazar et al. 2020), batched by rows (packed
        without padding with ``packed_logits_fn``)."""
        from pretrain.datamodules.unpadded import first_and_last, first_fit, pack

        rows, masked = self._pll_rows(requests)
        sums = [0.0] * len(requests)
        greedy = [True] * len(requests)
        if self.packed_logits_fn is not None:
            chunks = self._chunks([len(m) for m in masked])
        else:
            chunks = [
                list(range(s, min(s + self.batch_size, len(rows))))
                for s in range(0, len(rows), self.batch_size)
            ]
        for chunk in chunks:
            seqs = [masked[j] for j in chunk]
            if self.packed_logits_fn is not None:
                width = max(map(len, seqs))
                packed = pack(seqs, first_fit([[len(s)] for s in seqs], [width]), width, self.pad_token_id)
                keys = ("tokens", "document_ids", "position_ids")
                logits = self.packed_logits_fn(*(packed[k].to(self.device) for k in keys)).flatten(0, 1)
                first, _ = first_and_last(packed["example_ids"], len(seqs))
                where = [int(f) + rows[j][1] for f, j in zip(first, chunk, strict=True)]
            else:
                ids, mask, _ = self._pad(seqs, "right")  # absolute positions from 0: no padding on the left
                logits = self.logits_fn(ids, mask).flatten(0, 1)  # (B * T, V)
                where = [b * ids.shape[1] + rows[j][1] for b, j in enumerate(chunk)]
            for at, j in zip(where, chunk, strict=True):
                r, pos, seq = rows[j]
                logprobs = F.log_softmax(logits[at].double(), dim=-1)  # (V,)
                sums[r] += float(logprobs[seq[pos]])
                greedy[r] &= int(logprobs.argmax()) == seq[pos]
        return list(zip(sums, greedy))

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def greedy_until(self, contexts: Sequence[str], until: Sequence[str], max_new_tokens: int) -> list[str]:
        """Greedy continuation of each context, cut before the first stop sequence (EOS always stops).

        Decoder-only contexts keep their last ``max_length - max_new_tokens`` tokens (as lm-eval).
        """
        if self.encoder_only:
            raise UnsupportedModelError(
                "an encoder-only (BERT-style) model does not generate text: generation tasks need a decoder "
                "or encoder-decoder checkpoint; score this one on multiple-choice or perplexity tasks"
            )
        if not self.seq2seq and max_new_tokens >= self.max_length:
            raise InputError(f"max_new_tokens={max_new_tokens} must be below max_length={self.max_length}")
        keep = self.max_length if self.seq2seq else self.max_length - max_new_tokens
        encoded = [self.encode(c)[-keep:] if c else [self.prefix_token_id] for c in contexts]
        order = sorted(range(len(contexts)), key=lambda i: -len(encoded[i]))
        results: list[str] = [""] * len(contexts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            new_tokens = self._greedy_batch([encoded[i] for i in chunk], until, max_new_tokens)
            for i, toks in zip(chunk, new_tokens):
                results[i] = _cut(self.decode(toks), until)
        return results

    def _greedy_batch(
        self, prompts: list[list[int]], until: Sequence[str], max_new_tokens: int
    ) -> list[list[int]]:
        """Newly generated ids per prompt (up to, excluding, EOS), decoding all prompts together."""
        # left padding: every row's next token sits at the last position
        ids, mask, _ = self._pad(prompts, self.padding_side if self.seq2seq else "left")
        steps = (self.decode_fn or self._uncached_decode)(ids, mask)
        logits = next(steps)  # (B, V)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            next_ids = logits.argmax(-1)  # (B,)
            for b, tok in enumerate(next_ids.tolist()):
                if done[b]:
                    continue
                if tok == self.eos_token_id:
                    done[b] = True
                    continue
                new[b].append(tok)
                text = self.decode(new[b])
                done[b] = any(stop and stop in text for stop in until)
            if all(done) or step == max_new_tokens - 1:
                break
            logits = steps.send(next_ids)
        steps.close()
        return new

    def _uncached_decode(self, ids: torch.Tensor, mask: torch.Tensor) -> DecodeSteps:
        """``DecodeFn`` from ``logits_fn`` alone: re-reads the whole sequence at every step (no KV cache)."""
        if self.seq2seq:
            dec = torch.full(
                (ids.shape[0], 1),
                self._required(self.decoder_start_token_id),
                dtype=torch.long,
                device=self.device,
            )
            while True:
                new = yield self.logits_fn(ids, mask, dec, torch.ones_like(dec))[:, -1]
                dec = torch.cat([dec, new[:, None]], dim=1)
        while True:
            new = yield self.logits_fn(ids, mask)[:, -1]
            ids = torch.cat([ids, new[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)


def _cut(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of each stop sequence (lm-eval's postprocessing)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
