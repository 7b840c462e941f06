"""Masked LM (objectives/mlm.py): 80/10/10 statistics next to transformers' collator, special tokens,
whole-word and span masking, sentence pairs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_data import packed_batch, tiny_tokenizer

from pretrain import objectives
from pretrain.datamodules.special_tokens import DEFAULT_SPECIAL_TOKENS, all_special_tokens
from pretrain.objectives.loss import IGNORE_INDEX

P, MASK, RANDOM = 0.15, 0.8, 0.1


def special_ids(tok) -> torch.Tensor:
    return torch.tensor(sorted(tok.token_to_id(t) for t in all_special_tokens()))


def split_counts(original: torch.Tensor, masked: torch.Tensor, labels: torch.Tensor, mask_id: int) -> dict:
    """Counts over the positions with a label: selected, [MASK], other token, unchanged."""
    selected = labels != IGNORE_INDEX
    is_mask = selected & (masked == mask_id)
    unchanged = selected & (masked == original)
    return {
        "selected": selected.sum().item(),
        "mask": is_mask.sum().item(),
        "random": (selected & ~is_mask & ~unchanged).sum().item(),
        "unchanged": unchanged.sum().item(),
    }


def assert_within_3_sigma(count: int, n: int, p: float, what: str) -> None:
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) <= 3 * sigma, f"{what}: {count} vs {n * p:.0f} +- {3 * sigma:.0f}"


def hf_collator_masking(tok, inputs: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers.DataCollatorForLanguageModeling's masking of the same batch, its special tokens being
    those the objective protects (the HF tokenizer wraps the same tokenizers.Tokenizer)."""
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    roles = {f"{role}_token": token for role, token in DEFAULT_SPECIAL_TOKENS.items()}
    extra = [t for t in all_special_tokens() if t not in DEFAULT_SPECIAL_TOKENS.values()]
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, **roles, additional_special_tokens=extra)
    assert sorted(hf_tok.all_special_ids) == special_ids(tok).tolist()
    collator = DataCollatorForLanguageModeling(hf_tok, mlm_probability=P)
    collator.generator = torch.Generator().manual_seed(seed)
    special_mask = torch.isin(inputs, torch.tensor(hf_tok.all_special_ids))
    return collator.torch_mask_tokens(inputs.clone(), special_tokens_mask=special_mask)


def test_statistics_on_a_million_positions_match_bert_and_transformers():
    tok = tiny_tokenizer()
    obj = objectives.build("mlm", tok)
    raw = packed_batch(1000, obj.raw_length(1002), seed=7)  # 1e6 raw positions
    out = obj(raw, torch.Generator().manual_seed(0))
    inputs = torch.cat([torch.full((1000, 1), obj.cls_id), raw, torch.full((1000, 1), obj.sep_id)], dim=1)
    hf_masked, hf_labels = hf_collator_masking(tok, inputs, seed=0)

    specials = special_ids(tok)
    candidates = (~torch.isin(inputs, specials)).sum().item()
    n_replacements = tok.get_vocab_size() - len(specials)
    p_random_visible = RANDOM * (1 - 1 / n_replacements)  # a random token may equal the original
    ours = split_counts(inputs, out["input_ids"], out["labels"], obj.mask_id)
    theirs = split_counts(inputs, hf_masked, hf_labels, obj.mask_id)
    for name, c in (("ours", ours), ("transformers", theirs)):
        assert_within_3_sigma(c["selected"], candidates, P, f"{name} selected")
        assert_within_3_sigma(c["mask"], c["selected"], MASK, f"{name} [MASK]")
        assert_within_3_sigma(c["random"], c["selected"], p_random_visible, f"{name} random")
        assert_within_3_sigma(c["unchanged"], c["selected"], 1 - MASK - p_random_visible, f"{name} unchanged")
    sigma = math.sqrt(2 * candidates * P * (1 - P))
    assert abs(ours["selected"] - theirs["selected"]) <= 3 * sigma

    # no special token is ever selected or inserted by the objective; transformers does insert them
    assert not torch.isin(inputs[out["labels"] != IGNORE_INDEX], specials).any()
    changed = out["input_ids"] != inputs
    assert not torch.isin(out["input_ids"][changed & (out["input_ids"] != obj.mask_id)], specials).any()
    assert torch.equal(out["labels"][out["labels"] != IGNORE_INDEX], inputs[out["labels"] != IGNORE_INDEX])
    assert torch.equal(out["input_ids"][out["labels"] == IGNORE_INDEX], inputs[out["labels"] == IGNORE_INDEX])
    hf_random = (hf_masked != inputs) & (hf_masked != obj.mask_id)
    assert torch.isin(hf_masked[hf_random], specials).any()


def test_configurable_probabilities():
    obj = objectives.build(
        "mlm", tiny_tokenizer(), mlm_probability=0.4, mask_replace_prob=0.5, random_replace_prob=0.5
    )
    raw = packed_batch(200, obj.raw_length(512), seed=3)
    out = obj(raw, torch.Generator().manual_seed(1))
    selected = out["labels"] != IGNORE_INDEX
    candidates = (~obj.is_special[torch.nn.functional.pad(raw, (1, 1), value=obj.cls_id)]).sum().item()
    assert_within_3_sigma(selected.sum().item(), candidates, 0.4, "selected")
    assert_within_3_sigma(
        (out["input_ids"][selected] == obj.mask_id).sum().item(), selected.sum().item(), 0.5, "mask"
    )
    assert_within_3_sigma((out["input_ids"][selected] == out["labels"][selected]).sum().item(), selected.sum().item(),
                          0.5 / len(obj.replacement_ids), "unchanged")  # fmt: skip


def words(tok, row: torch.Tensor) -> list[list[int]]:
    """Positions of each word of a row: a 'Ġ' token or a special token starts one (specials are words)."""
    specials = set(special_ids(tok).tolist())
    out: list[list[int]] = []
    for i, t in enumerate(row.tolist()):
        starts = (
            not out or t in specials or row[i - 1].item() in specials or tok.id_to_token(t).startswith("Ġ")
        )
        out.append([i]) if starts else out[-1].append(i)
    return out


def test_whole_word_masking_selects_whole_words_at_the_rate():
    tok = tiny_tokenizer()
    obj = objectives.build("mlm", tok, whole_word_mask=True)
    raw = packed_batch(200, obj.raw_length(256), seed=4)
    out = obj(raw, torch.Generator().manual_seed(2))
    selected = out["labels"] != IGNORE_INDEX
    specials = set(special_ids(tok).tolist())
    n_selected, n_tokens, sum_sq = 0, 0, 0
    full = torch.nn.functional.pad(raw, (1, 1), value=obj.cls_id)
    for row, sel in zip(full, selected):
        for word in words(tok, row):
            flags = sel[word]
            assert flags.all() or not flags.any(), "a word is partly selected"
            if row[word[0]].item() not in specials:
                n_selected += int(flags.sum())
                n_tokens += len(word)
                sum_sq += len(word) ** 2
    assert sum_sq > 1.5 * n_tokens  # many multi-token words
    assert abs(n_selected - P * n_tokens) <= 3 * math.sqrt(P * (1 - P) * sum_sq)


def runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of True."""
    padded = torch.nn.functional.pad(mask_row.int(), (1, 1))
    edges = padded.diff().tolist()
    starts = [i for i, e in enumerate(edges) if e == 1]
    return list(zip(starts, [i for i, e in enumerate(edges) if e == -1]))


def test_span_masking_is_spanbert_like():
    tok = tiny_tokenizer()
    obj = objectives.build("mlm", tok, span_masking=True)
    raw = packed_batch(400, obj.raw_length(512), seed=5)
    out = obj(raw, torch.Generator().manual_seed(3))
    selected = out["labels"] != IGNORE_INDEX
    candidates = (~obj.is_special[torch.nn.functional.pad(raw, (1, 1), value=obj.cls_id)]).sum().item()
    assert abs(selected.sum().item() / candidates - P) < 0.005
    is_mask = out["input_ids"] == obj.mask_id
    for sel_row, mask_row in zip(selected[:50], is_mask[:50]):
        for a, b in runs(sel_row):
            assert mask_row[a:b].all() or not mask_row[a:b].any(), "80/10/10 is decided per span"

    # with sparse spans (few overlaps) run lengths follow the geometric(0.2) truncated to 10: mean 3.80
    sparse = objectives.build("mlm", tok, span_masking=True, mlm_probability=0.03)
    raw = packed_batch(800, sparse.raw_length(512), seed=6).clamp_min(200)  # no special token breaks a span
    selected = sparse(raw, torch.Generator().manual_seed(4))["labels"][:, 1:-1] != IGNORE_INDEX
    lengths = torch.tensor([b - a for row in selected for a, b in runs(row)], dtype=torch.float)
    assert abs(lengths.mean().item() - 3.797) < 0.15, lengths.mean()
    assert (lengths <= 10).float().mean() > 0.98


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(3, 80),
    seed=st.integers(0, 2**32),
    whole_word=st.booleans(),
    span=st.booleans(),
)
def test_labels_and_inputs_agree_with_the_original(length, seed, whole_word, span):
    obj = objectives.build("mlm", tiny_tokenizer(), whole_word_mask=whole_word, span_masking=span)
    raw = packed_batch(4, obj.raw_length(length), seed=seed % 1000)
    out = obj(raw, torch.Generator().manual_seed(seed))
    original = torch.nn.functional.pad(raw, (1, 1), value=obj.cls_id)
    original[:, -1] = obj.sep_id
    selected = out["labels"] != IGNORE_INDEX
    assert out["input_ids"].shape == (4, length)
    assert torch.equal(out["labels"][selected], original[selected])
    assert torch.equal(out["input_ids"][~selected], original[~selected])
    assert not obj.is_special[original[selected]].any()
    assert not obj.is_special[out["input_ids"]][selected & (out["input_ids"] != obj.mask_id)].any()


def test_missing_mask_token_fails_at_set_up():
    with pytest.raises(ValueError, match="no mask token '<mask>'"):
        objectives.build("mlm", tiny_tokenizer(without=("<mask>",)))


def test_bad_probabilities_fail_at_set_up():
    with pytest.raises(ValueError, match="mlm_probability"):
        objectives.build("mlm", tiny_tokenizer(), mlm_probability=1.5)
    with pytest.raises(ValueError, match="sum <= 1"):
        objectives.build("mlm", tiny_tokenizer(), mask_replace_prob=0.9, random_replace_prob=0.2)
