"""The objective interface shared by all objectives (objectives/__init__.py, objectives/base.py)."""

from __future__ import annotations

import pytest
import torch
from objective_data import (
    ALL_OBJECTIVES,
    assert_equal_batches,
    build,
    generators,
    packed_batch,
    tiny_model,
    tiny_tokenizer,
)
from tokenizers import Tokenizer, models

from pretrain import objectives
from pretrain.objectives.base import row_generators


@pytest.mark.parametrize("key", sorted(ALL_OBJECTIVES))
def test_deterministic_for_a_seed(key):
    obj = build(key)
    tokens = packed_batch(6, obj.raw_length(64))
    first = obj(tokens, torch.Generator().manual_seed(3))
    assert_equal_batches(first, obj(tokens, torch.Generator().manual_seed(3)))
    if key != "clm":  # clm has no randomness
        other = obj(tokens, torch.Generator().manual_seed(4))
        assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("key", sorted(ALL_OBJECTIVES))
def test_per_sample_seeding_independent_of_batch_split(key):
    obj = build(key)
    tokens = packed_batch(8, obj.raw_length(64), seed=1)
    seeds = range(100, 108)
    whole = obj(tokens, generators(seeds))
    halves = [obj(tokens[i : i + 3], generators(seeds[i : i + 3])) for i in (0, 3)] + [
        obj(tokens[6:], generators(seeds[6:]))
    ]
    assert_equal_batches(whole, {k: torch.cat([h[k] for h in halves]) for k in whole})
    samples = [obj(tokens[i : i + 1], [g]) for i, g in enumerate(generators(seeds))]
    assert_equal_batches(whole, {k: torch.cat([s[k] for s in samples]) for k in whole})


@pytest.mark.parametrize("key", sorted(ALL_OBJECTIVES))
def test_outputs_are_forward_kwargs_plus_labels(key):
    obj = build(key)
    out = obj(packed_batch(3, obj.raw_length(64)), torch.Generator().manual_seed(0))
    forward_kwargs = {
        "input_ids", "attention_mask", "token_type_ids", "position_ids", "document_ids", "prefix_lengths",
        "decoder_input_ids", "decoder_attention_mask",
    }  # fmt: skip
    assert {"input_ids", "attention_mask", "labels"} <= set(out) <= forward_kwargs | {"labels"}
    assert all(v.dtype == torch.long and v.shape[0] == 3 for v in out.values())
    assert out["input_ids"].shape[1] == 64
    assert ("decoder_input_ids" in out) == ("encoder-decoder" in obj.architectures)


def test_build_rejects_unknown_names_and_options():
    tok = tiny_tokenizer()
    with pytest.raises(
        ValueError, match=r"valid objectives: \['clm', 'mlm', 'prefix_lm', 'sgns', 'span_corruption', 'ul2'\]"
    ):
        objectives.build("bert", tok)
    with pytest.raises(ValueError, match=r"unknown options \['mask_prob'\].*mlm_probability"):
        objectives.build("mlm", tok, mask_prob=0.2)
    with pytest.raises(ValueError, match=r"missing required options \['input_length'\]"):
        objectives.build("ul2", tok)


def test_the_options_checked_without_torch_are_the_objectives_signatures():
    """``pretrain.objectives.options`` (what a config check reads, torch-free) lists each objective's keyword
    arguments with their defaults and type hints (``Any`` where the hint names an array type)."""
    import inspect
    import typing

    from pretrain.objectives.options import OPTIONS

    assert set(OPTIONS) == set(objectives.OBJECTIVES)
    for name, cls in objectives.OBJECTIVES.items():
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
        assert list(OPTIONS[name]) == [p.name for p in parameters], name
        assert [d for _, d in OPTIONS[name].values()] == [p.default for p in parameters], name
        hints = typing.get_type_hints(cls.__init__)
        typed = [k for k, (tp, _) in OPTIONS[name].items() if tp is not typing.Any]
        assert {k: OPTIONS[name][k][0] for k in typed} == {k: hints[k] for k in typed}, name


@pytest.mark.parametrize(
    ("key", "fits", "misfits"),
    [
        ("clm", "decoder", "encoder"),
        ("mlm", "encoder", "decoder"),
        ("span_corruption", "encoder-decoder", "decoder"),
        ("prefix_lm", "decoder", "encoder-decoder"),
        ("prefix_lm_encdec", "encoder-decoder", "decoder"),
        ("ul2", "encoder-decoder", "encoder"),
    ],
)
def test_architecture_check(key, fits, misfits):
    obj = build(key)
    obj.check_architecture(fits)
    with pytest.raises(ValueError, match=f"arch={misfits!r}"):
        obj.check_architecture(misfits)


def test_required_tokens_are_declared():
    assert build("mlm").required_tokens == ("<mask>", "<cls>", "<sep>", "<pad>")
    assert set(build("span_corruption").required_tokens) == {"</s>", "<pad>", "<extra_id_0>"}
    assert {"[NLU]", "[S2S]", "[NLG]", "<extra_id_0>"} <= set(build("ul2").required_tokens)
    assert objectives.build("clm", tiny_tokenizer()).required_tokens == ()


def test_special_token_overrides_map_roles():
    gpt2_like = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}, unk_token="a"))
    with pytest.raises(ValueError, match="no eos token '</s>'"):
        objectives.build("span_corruption", gpt2_like)
    with pytest.raises(ValueError, match="no pad token"):  # eos found under its override; pad is next
        objectives.build("span_corruption", gpt2_like, special_tokens={"eos": "<|endoftext|>"})


def test_row_generators_needs_one_per_row():
    assert len(row_generators(torch.Generator().manual_seed(0), 5)) == 5
    with pytest.raises(ValueError, match="2 generators for a batch of 3 rows"):
        row_generators(generators([1, 2]), 3)


def test_rejects_non_long_tokens():
    with pytest.raises(ValueError, match="LongTensor"):
        build("clm")(torch.zeros(2, 5, dtype=torch.int32), torch.Generator())


@pytest.mark.parametrize("key", sorted(ALL_OBJECTIVES))
def test_backbone_accepts_the_batch(key):
    """Every key is a keyword argument of the backbone's forward, and the loss is finite."""
    obj = build(key)
    model = tiny_model(next(iter(obj.architectures)), tiny_tokenizer().get_vocab_size())
    batch = obj(packed_batch(2, obj.raw_length(64)), torch.Generator().manual_seed(0))
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model[1](model[0], **batch)
    assert logits.shape[:2] == labels.shape
    loss_sum, n = obj.loss(logits, labels)
    assert n > 0 and torch.isfinite(loss_sum)
