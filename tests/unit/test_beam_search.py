"""Beam search: beam 1 is greedy, and the hypotheses and scores equal transformers' generate(num_beams=k, ...)."""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.models.beam_search import beam_search
from pretrain.models.config import ModelConfig
from pretrain.models.generation import generate
from pretrain.models.transformer import Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers
from model_zoo import random_hf_t5

from pretrain.models.hf import from_hf

V, EOS, PAD = 61, 1, 0


def hf_t5(eos_weight: float) -> transformers.T5ForConditionalGeneration:
    """A small random T5 with peaked distributions; ``eos_weight`` scales how often EOS wins (early hypotheses)."""
    model = random_hf_t5(V, EOS, PAD)
    with torch.no_grad():
        model.lm_head.weight[EOS] = eos_weight * model.lm_head.weight[2]
    return model


def source() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(2, V, (4, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[1, 5:] = 0
    mask[3, 4:] = 0
    return x, mask


def until_eos(sequences: torch.Tensor, prompt: int) -> list[list[int]]:
    """Generated tokens up to and including the first EOS (HF and we pad finished rows differently)."""
    rows = []
    for row in sequences[:, prompt:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


SETTINGS = [  # (num_beams, length_penalty, early_stopping)
    (3, 1.0, False),
    (4, 0.6, True),
    (4, 2.0, "never"),
    (5, -0.5, False),
    (2, 0.0, "never"),
]


@pytest.mark.parametrize("eos_weight", [0.0, 2.0])
def test_t5_matches_transformers_generate(eos_weight):
    hf = hf_t5(eos_weight)
    ours = from_hf(hf).eval()
    x, mask = source()
    lengths = set()
    for k, lp, es in SETTINGS:
        ref = hf.generate(
            input_ids=x,
            attention_mask=mask,
            num_beams=k,
            length_penalty=lp,
            early_stopping=es,
            max_new_tokens=12,
            do_sample=False,
            num_return_sequences=2,
            return_dict_in_generate=True,
            output_scores=True,
        )
        out = beam_search(
            ours,
            None,
            12,
            num_beams=k,
            length_penalty=lp,
            early_stopping=es,
            num_return_sequences=2,
            encoder_input_ids=x,
            encoder_attention_mask=mask,
        )
        assert until_eos(out.sequences, 1) == until_eos(ref.sequences, 1), (k, lp, es)
        torch.testing.assert_close(out.scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)
        lengths |= {len(r) for r in until_eos(out.sequences, 1)}
    if eos_weight:  # the finished-hypothesis pool really was exercised: early EOS and full-length hypotheses
        assert min(lengths) < 12 and max(lengths) == 12


def test_gpt2_left_padded_matches_transformers_generate():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=40,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(2.0)
    ours = from_hf(hf).eval()
    x = torch.randint(2, V, (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[0, :2] = 0  # left padding
    x = x.masked_fill(mask == 0, PAD)
    for k, lp, es in SETTINGS[:3]:
        ref = hf.generate(
            input_ids=x,
            attention_mask=mask,
            num_beams=k,
            length_penalty=lp,
            early_stopping=es,
            max_new_tokens=8,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
        out = beam_search(
            ours,
            x,
            8,
            num_beams=k,
            length_penalty=lp,
            early_stopping=es,
            attention_mask=mask,
            pad_token_id=PAD,
        )
        assert until_eos(out.sequences, 6) == until_eos(ref.sequences, 6)
        torch.testing.assert_close(out.scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)


def test_stepping_past_the_stop_changes_nothing():
    """A sharded rank whose batch has stopped keeps stepping until every rank has (``all_finished``): its
    hypotheses and scores are those of the search that stopped on its own."""
    model = from_hf(hf_t5(eos_weight=4.0)).eval()  # early EOS: one source's searches stop before 12 tokens
    x, mask = (t[:1] for t in source())
    stopped_at = []
    for k, lp, es in SETTINGS:
        stops: list[bool] = []

        def other_rank_busy(stop: torch.Tensor, stops: list[bool] = stops) -> bool:
            stops.append(bool(stop))
            return False  # never: the search runs to max_new_tokens

        args = {"num_beams": k, "length_penalty": lp, "early_stopping": es, "num_return_sequences": 2}
        source_ = {"encoder_input_ids": x, "encoder_attention_mask": mask}
        alone = beam_search(model, None, 12, **args, **source_)
        stepped = beam_search(model, None, 12, **args, **source_, all_finished=other_rank_busy)
        assert len(stops) == 12 and stops[-1], (k, lp, es)  # every step of max_new_tokens ran
        stopped_at.append(stops.index(True))
        assert stepped.sequences.tolist() == alone.sequences.tolist(), (k, lp, es)
        assert stepped.scores.tolist() == alone.scores.tolist(), (k, lp, es)
    assert min(stopped_at) < 6  # searches that stopped early really stepped on


@pytest.mark.parametrize("eos_weight", [0.0, 2.0])
def test_one_beam_is_greedy(eos_weight):
    model = from_hf(hf_t5(eos_weight)).eval()
    x, mask = source()
    greedy = generate(model, None, 10, greedy=True, encoder_input_ids=x, encoder_attention_mask=mask)
    beam = beam_search(model, None, 10, num_beams=1, encoder_input_ids=x, encoder_attention_mask=mask)
    assert beam.sequences.tolist() == greedy[:, : beam.sequences.shape[1]].tolist()
    assert (greedy[:, beam.sequences.shape[1] :] == PAD).all()


def test_decoder_one_beam_is_greedy_and_restores_training_mode():
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(arch="decoder", vocab_size=V, d_model=24, n_layer=2, n_head=3, max_seq_len=32)
    )
    x = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(0))
    out = beam_search(model, x, 6, num_beams=1)
    assert model.training
    assert out.sequences.tolist() == generate(model, x, 6, greedy=True).tolist()


def test_reorder_cache_selects_rows():
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(arch="decoder", vocab_size=V, d_model=24, n_layer=2, n_head=3, max_seq_len=32)
    )
    x = torch.randint(0, V, (3, 4))
    cache = model(x, use_cache=True).cache
    before = [kv[0].clone() for kv in cache.self_kv]
    cache.reorder(torch.tensor([2, 2, 0]))
    for old, (k, _) in zip(before, cache.self_kv, strict=True):
        assert torch.equal(k, old[[2, 2, 0]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_arguments(kwargs, message):
    model = Transformer(
        ModelConfig(arch="decoder", vocab_size=V, d_model=24, n_layer=1, n_head=3, max_seq_len=32)
    )
    with pytest.raises(ValueError, match=message):
        beam_search(model, torch.zeros(1, 2, dtype=torch.long), 4, **kwargs)


def test_encoder_only_model_cannot_beam_search():
    model = Transformer(
        ModelConfig(arch="encoder", vocab_size=V, d_model=24, n_layer=1, n_head=3, max_seq_len=32)
    )
    with pytest.raises(ValueError, match="decoder"):
        beam_search(model, torch.zeros(1, 2, dtype=torch.long), 4, num_beams=2)
