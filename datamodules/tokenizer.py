"""Byte-level BPE tokenizers: training (``tokenizers``), loading, and set-up checks.

The byte-level BPE is GPT-2's (Radford et al., 2019): text is split by the GPT-2 pre-tokenization regex,
each piece's UTF-8 bytes are mapped to printable characters (``bytes_to_unicode``), and merges are
learned within pieces. Every text round-trips exactly: ``decode(encode(t), skip_special_tokens=False) == t``.

Training adds the special tokens the objectives need (``special_tokens.all_special_tokens()``: pad, bos,
eos, unk, mask, cls, sep, 100 sentinels, UL2 mode tokens) with the first ids, then the 256 byte symbols,
then the merges. Special-token strings inside the training text are cut out before pre-tokenization, so
no merge is learned across or inside them.

Encoding user text: ``TextEncoder`` is the one place text becomes token ids (prepare, finetuning, text-to-text,
generation prompts, the context-length evaluation). Text that spells a special token (``</s>``, ``<mask>``,
``<extra_id_0>``, ``<|endoftext|>``...) is encoded as the ordinary text it is; only the framework inserts control
ids, by id (EOS after a document, a template's [CLS]/[SEP], sentinels). The lm-eval scorer
(``pretrain.evaluation.scoring``) is the exception: it encodes prompts as lm-eval's HF model does, which matches
special-token text as control tokens, so its scores stay identical to lm-eval's (``docs/data.md``).

Ties: ``tokenizers``' trainer picks, among pairs of equal count, the pair with the smallest token ids
(earlier-created tokens first); some reference trainers (e.g. Stanford CS336's) pick the lexicographically
greatest pair of byte strings. Both learn the same merges up to the first tie where these rules disagree.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import AddedToken, Encoding, Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.datamodules.corpus import batched, iter_documents, resolve_sources
from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, all_special_tokens, special_token_id
from pretrain.errors import InputError
from pretrain.io import atomic_write_text

NUM_BYTES = 256
_GPT2_SPECIAL = re.compile(r"^<\|[a-z_]+\|>$")  # GPT-2 style specials in a vocab.json: <|endoftext|>


class TextEncoder:
    """The one way user text becomes token ids: special-token strings in it are ordinary text.

    ``tokenizers`` matches added special tokens in raw text (``"a </s> b"`` would give an EOS id mid-document)
    unless ``Tokenizer.encode_special_tokens`` is set; this class sets it on its own copy of ``tokenizer`` (the
    flag is not serialised: it is set again after unpickling, e.g. in a worker process). Non-special added tokens
    are vocabulary words and still match. ``tokenizer`` (the copy) may be given a template (``post_processor``)
    and truncation by the caller: ``encodings`` applies them, and a template inserts its control ids by id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.encode_special_tokens = True

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no template (``add_special_tokens=False``)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # no offsets
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, no template."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encodings(self, inputs: Sequence[str | tuple[str, str]]) -> list[Encoding]:
        """``Encoding``s of texts or text pairs with the tokenizer's template and truncation (ids, type ids)."""
        return self.tokenizer.encode_batch(list(inputs))

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer.to_str()}

    def __setstate__(self, state: dict) -> None:
        self.tokenizer = Tokenizer.from_str(state["tokenizer"])
        self.tokenizer.encode_special_tokens = True


_TEXT_ENCODERS: dict[int, tuple[Tokenizer, TextEncoder]] = {}  # id(tokenizer) -> (tokenizer, its encoder)


def text_encoder(tokenizer: Tokenizer) -> TextEncoder:
    """``TextEncoder(tokenizer)``, the same one for the same tokenizer object (a few are kept): its copy keeps its
    BPE cache warm across calls (``prepare`` called again in one process), and is not copied again. For a
    tokenizer that will not be changed afterwards (a template or truncation needs ``TextEncoder`` itself)."""
    key = id(tokenizer)
    if key not in _TEXT_ENCODERS or _TEXT_ENCODERS[key][0] is not tokenizer:
        if len(_TEXT_ENCODERS) >= 4:
            del _TEXT_ENCODERS[next(iter(_TEXT_ENCODERS))]
        _TEXT_ENCODERS[key] = (tokenizer, TextEncoder(tokenizer))
    return _TEXT_ENCODERS[key][1]


def byte_level_bpe(
    vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None
) -> Tokenizer:
    """An (optionally empty) GPT-2 style byte-level BPE: no normalizer, GPT-2 regex, no prefix space."""
    model = models.BPE(vocab, merges) if vocab is not None else models.BPE()
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _split_on_specials(docs: Iterable[str], specials: list[str]) -> Iterator[str]:
    """Drop special-token strings from training text, yielding the pieces between them."""
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    first_chars = {s[0] for s in specials}
    for doc in docs:
        if any(c in doc for c in first_chars):
            yield from (piece for piece in pattern.split(doc) if piece)
        else:
            yield doc


def train_bpe(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike | None = None,
    *,
    special_tokens: Iterable[str] | None = None,
    min_frequency: int = 0,
    document: str = "blank_line",
    text_field: str = "text",
    split: str = "train",
    on_invalid_utf8: str = "error",
    show_progress: bool = True,
) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens and 256 bytes included) on ``inputs``
    (text/JSONL/Parquet files, directories, globs or ``datasets`` names; see ``pretrain.datamodules.corpus``).

    ``special_tokens`` defaults to ``all_special_tokens()``; they get ids 0.. in the order given. Writes
    ``out_path`` (a ``tokenizer.json`` file, or a directory to hold one) when given.
    """
    specials = list(all_special_tokens() if special_tokens is None else special_tokens)
    if len(set(specials)) != len(specials):
        raise InputError(f"special_tokens contains duplicates: {specials}")
    minimum = len(specials) + NUM_BYTES
    if vocab_size < minimum:
        raise InputError(
            f"tokenizer.vocab_size={vocab_size} is too small: {len(specials)} special tokens + {NUM_BYTES} bytes "
            f"need at least {minimum}; raise tokenizer.vocab_size"
        )
    sources = resolve_sources(inputs, split)
    docs = iter_documents(sources, document=document, text_field=text_field, on_invalid_utf8=on_invalid_utf8)
    if specials:
        docs = _split_on_specials(docs, specials)
    tokenizer = byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    trained = False

    def batches() -> Iterator[list[str]]:
        nonlocal trained
        for batch in batched(docs):
            trained = True
            yield batch

    tokenizer.train_from_iterator(batches(), trainer)
    if not trained:
        raise InputError(f"no text in {[s.location for s in sources]}: the corpus is empty")
    if out_path is not None:
        save_tokenizer(tokenizer, out_path)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_path: str | os.PathLike) -> Path:
    """Save as ``tokenizer.json`` (``out_path`` is that file, or a directory to put it in)."""
    path = Path(out_path)
    if path.suffix != ".json":
        path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, tokenizer.to_str(pretty=True))  # a failed write keeps the previous file intact
    return path


def load_gpt2_files(vocab_file: str | os.PathLike, merges_file: str | os.PathLike) -> Tokenizer:
    """A tokenizer from GPT-2 style ``vocab.json`` + ``merges.txt``, encoding exactly as
    ``transformers.GPT2TokenizerFast(vocab_file, merges_file)``; ``<|...|>`` entries become special tokens."""
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    merges = []
    with open(merges_file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line_no == 1 and line.startswith("#version"):
                continue
            if not line:
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise InputError(
                    f"{merges_file}:{line_no}: expected two space-separated symbols, got {line!r}"
                )
            merges.append((parts[0], parts[1]))
    tokenizer = byte_level_bpe(vocab, merges)
    specials = sorted((t for t in vocab if _GPT2_SPECIAL.match(t)), key=vocab.__getitem__)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json``, a directory holding one, or a directory (or ``vocab.json`` path) with
    GPT-2 style ``vocab.json`` + ``merges.txt``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {path} not found; train one with `pretrain tokenizer`")
    if path.is_file() and path.name != "vocab.json":
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:
            raise InputError(f"{path} is not a valid tokenizer.json ({err})") from err
    directory = path if path.is_dir() else path.parent
    if (directory / "tokenizer.json").is_file() and path.is_dir():
        return load_tokenizer(directory / "tokenizer.json")
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return load_gpt2_files(vocab, merges)
    raise FileNotFoundError(f"{path} holds neither tokenizer.json nor vocab.json + merges.txt")


def check_tokenizer(
    tokenizer: Tokenizer,
    vocab_size: int | None = None,
    required: Iterable[str] = (),
    overrides: dict[str, str] | None = None,
) -> dict[str, int]:
    """Set-up check: the model's ``vocab_size`` covers every token id, and each ``required`` token exists.

    ``required`` items are roles (``"eos"``, ``"mask"``, ... mapped through ``overrides``) or literal token
    strings (``"<extra_id_0>"``, ``"[NLU]"``). Returns ``{item: id}``; raises ``ValueError`` naming the fix.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        suggestion = -(-size // 64) * 64
        raise InputError(
            f"the tokenizer has {size} tokens but the model's vocab_size is {vocab_size}: ids >= {vocab_size} "
            f"would index past the embedding; set model.vocab_size >= {size} (e.g. {suggestion}, a multiple of 64)"
        )
    roles = {**DEFAULT_SPECIAL_TOKENS, **(overrides or {})}
    ids = {}
    missing = []
    for item in required:
        if item in roles:
            ids[item] = special_token_id(tokenizer, item, overrides)
            continue
        token_id = tokenizer.token_to_id(item)
        if token_id is None:
            missing.append(item)
        else:
            ids[item] = token_id
    if missing:
        raise InputError(
            f"the tokenizer lacks the special token(s) {missing} that the objective needs; train it with "
            f"`pretrain tokenizer` (which adds all of them) or pick an objective that does not need them"
        )
    return ids


def resolve_eos(tokenizer: Tokenizer, eos_token: str | None = None) -> tuple[str, int]:
    """The end-of-document token: ``eos_token`` if given, else ``</s>``, else GPT-2's ``<|endoftext|>``."""
    candidates = [eos_token] if eos_token else [DEFAULT_SPECIAL_TOKENS["eos"], "<|endoftext|>"]
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    raise InputError(
        f"the tokenizer has none of the EOS tokens {candidates}; pass eos_token=<a token in the vocab>"
    )
