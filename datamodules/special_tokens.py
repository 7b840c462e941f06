"""Names of the special tokens the objectives rely on, and their lookup in a tokenizer.

Objectives ask for tokens by *role* (``"mask"``, ``"eos"``, ...). A role maps to a token string
(``DEFAULT_SPECIAL_TOKENS``, overridable per tokenizer, e.g. GPT-2 uses ``<|endoftext|>`` for eos),
and the id is always looked up by name in the tokenizer, never computed from the vocab size.
"""

from __future__ import annotations

from typing import Protocol

from pretrain.errors import InputError

DEFAULT_SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<pad>",
    "bos": "<s>",
    "eos": "</s>",
    "unk": "<unk>",
    "mask": "<mask>",
    "cls": "<cls>",
    "sep": "<sep>",
}
NUM_SENTINELS = 100
UL2_MODE_TOKENS: dict[str, str] = {"R": "[NLU]", "S": "[S2S]", "X": "[NLG]"}


def sentinel_token(i: int) -> str:
    """T5's i-th sentinel, ``<extra_id_i>``."""
    return f"<extra_id_{i}>"


def all_special_tokens(num_sentinels: int = NUM_SENTINELS) -> list[str]:
    """Every special token a tokenizer trained by this project carries, in id order."""
    return (
        list(DEFAULT_SPECIAL_TOKENS.values())
        + [sentinel_token(i) for i in range(num_sentinels)]
        + list(UL2_MODE_TOKENS.values())
    )


class TokenLookup(Protocol):
    """What the objectives need of a tokenizer (``tokenizers.Tokenizer`` satisfies it)."""

    def token_to_id(self, token: str) -> int | None: ...

    def get_vocab_size(self, with_added_tokens: bool = True) -> int: ...


def special_token_id(tokenizer: TokenLookup, role: str, overrides: dict[str, str] | None = None) -> int:
    """Id of the token playing ``role``; a ``ValueError`` names the role and token when it is missing."""
    table = {**DEFAULT_SPECIAL_TOKENS, **(overrides or {})}
    if role not in table:
        raise InputError(f"unknown special-token role {role!r}; valid roles: {sorted(table)}")
    token = table[role]
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise InputError(
            f"the tokenizer has no {role} token {token!r}; train it with `pretrain tokenizer` "
            f"(which adds all special tokens) or map the role to an existing token "
            f"(special_tokens.{role}=...)"
        )
    return token_id


def sentinel_ids(tokenizer: TokenLookup, count: int) -> list[int]:
    """Ids of ``<extra_id_0>`` .. ``<extra_id_{count-1}>``, looked up by name."""
    ids = []
    for i in range(count):
        token_id = tokenizer.token_to_id(sentinel_token(i))
        if token_id is None:
            raise InputError(
                f"the tokenizer has only {i} sentinel tokens but {count} are needed "
                f"(missing {sentinel_token(i)!r}); train the tokenizer with at least {count} sentinels "
                f"or lower the noise density / raise the mean span length"
            )
        ids.append(token_id)
    return ids
