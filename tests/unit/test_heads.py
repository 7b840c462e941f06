"""Task heads: pooling, logits equal to transformers' BertFor* / GPT2ForSequenceClassification, architecture checks."""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel, check_head, default_pooling, pool
from pretrain.models.transformer import Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from pretrain.models.hf import from_hf

V, PAD = 53, 0


def batch(B: int = 3, T: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask with different lengths per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    lengths = torch.tensor([T - 2 * b for b in range(B)])  # T, T - 2, ...
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def test_pool_first_last_mean():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])  # right- and left-padded rows
    assert torch.equal(pool(hidden, mask, "first"), hidden[:, 0])
    assert torch.equal(pool(hidden, mask, "last"), torch.stack([hidden[0, 1], hidden[1, 3]]))
    expected = torch.stack([hidden[0, :2].mean(0), hidden[1, 1:].mean(0)])
    torch.testing.assert_close(pool(hidden, mask, "mean"), expected)


def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=V,
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=40,
        max_position_embeddings=32,
        pad_token_id=PAD,
        **kw,
    )


@pytest.mark.parametrize("kind", ["sequence", "token", "multiple_choice"])
def test_bert_heads_match_transformers(kind):
    torch.manual_seed(0)
    cls = {
        "sequence": transformers.BertForSequenceClassification,
        "token": transformers.BertForTokenClassification,
        "multiple_choice": transformers.BertForMultipleChoice,
    }[kind]
    hf = cls(_bert_config(num_labels=3)).eval()
    model = TaskModel(from_hf(hf.bert), kind, 3).eval()  # BertModel keeps its pooler -> pooling "pooler"
    model.head.out.load_state_dict(hf.classifier.state_dict())
    ids, mask = batch(6, 13)
    if kind == "multiple_choice":  # 2 questions x 3 choices
        ids, mask = ids.view(2, 3, -1), mask.view(2, 3, -1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        ours = model(ids, mask)
    assert ours.shape == ref.shape
    real = mask.bool() if kind == "token" else slice(None)
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-4, atol=1e-5)


def test_gpt2_sequence_head_matches_transformers():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=24, n_layer=2, n_head=3, pad_token_id=PAD, num_labels=2
    )
    hf = transformers.GPT2ForSequenceClassification(cfg).eval()
    lm = transformers.GPT2LMHeadModel(cfg)
    lm.transformer.load_state_dict(hf.transformer.state_dict())
    model = TaskModel(from_hf(lm), "sequence", 2).eval()
    assert model.pooling == "last" and model.backbone.lm_head is None
    model.head.out.load_state_dict(hf.score.state_dict())
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-5
        )


def test_t5_head_reads_the_mean_of_the_encoder_and_drops_the_decoder():
    torch.manual_seed(0)
    backbone = Transformer(
        ModelConfig(
            arch="encoder-decoder",
            vocab_size=V,
            d_model=24,
            n_layer=2,
            n_head=3,
            norm="rmsnorm",
            norm_bias=False,
            position="relative",
            attn_scale="none",
            init="t5",
            decoder_start_token_id=PAD,
        )
    ).eval()
    ids, mask = batch()
    with torch.no_grad():
        encoded = backbone.encode(ids, mask)
    model = TaskModel(backbone, "sequence", 1, dropout=0.0).eval()
    assert model.pooling == "mean" and backbone.decoder is None and backbone.lm_head is None
    expected = model.head.out((encoded * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), expected)


def test_default_pooling_per_architecture():
    configs = {
        "first": ModelConfig(arch="encoder", vocab_size=V, d_model=24, n_layer=1, n_head=3),
        "pooler": ModelConfig(arch="encoder", vocab_size=V, d_model=24, n_layer=1, n_head=3, pooler=True),
        "last": ModelConfig(arch="decoder", vocab_size=V, d_model=24, n_layer=1, n_head=3),
        "mean": ModelConfig(arch="encoder-decoder", vocab_size=V, d_model=24, n_layer=1, n_head=3),
    }
    for expected, cfg in configs.items():
        assert default_pooling(cfg) == expected


@pytest.mark.parametrize(
    "arch, kind, pooling, message",
    [
        ("decoder", "sequence", "first", "does not fit arch 'decoder'"),
        ("decoder", "multiple_choice", "mean", "does not fit arch 'decoder'"),
        ("encoder", "sequence", "last", "does not fit arch 'encoder'"),
        ("encoder", "sequence", "pooler", "needs a backbone with BERT's pooler"),
        ("encoder-decoder", "sequence", "last", "does not fit arch 'encoder-decoder'"),
        ("encoder", "span", "first", "head kind 'span'"),
    ],
)
def test_heads_that_do_not_fit_the_architecture(arch, kind, pooling, message):
    cfg = ModelConfig(arch=arch, vocab_size=V, d_model=24, n_layer=1, n_head=3)
    with pytest.raises(ValueError, match=message):
        check_head(cfg, kind, pooling)
    with pytest.raises(ValueError, match=message):
        TaskModel(Transformer(cfg), kind, 2, pooling=pooling)


def test_multiple_choice_needs_three_dimensional_inputs():
    model = TaskModel(
        Transformer(ModelConfig(arch="encoder", vocab_size=V, d_model=24, n_layer=1, n_head=3)),
        "multiple_choice",
        4,
    )
    with pytest.raises(ValueError, match=r"\(B, C, T\)"):
        model(torch.zeros(2, 5, dtype=torch.long))
