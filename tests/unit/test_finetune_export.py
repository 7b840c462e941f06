"""A finetuned sequence head exported to transformers computes our logits (BERT's pooler head ->
BertForSequenceClassification, a decoder's last-token head -> GPT2 / Llama ForSequenceClassification, regression
too); heads transformers cannot represent are refused in one line."""

from __future__ import annotations

import os

import pytest
import torch
from model_zoo import SCORING_ARCHS
from training_utils import TINY_MODEL

from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel
from pretrain.models.hf import classifier_to_hf
from pretrain.models.transformer import Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V, PAD = 50, 0
TINY = {
    "vocab_size": V,
    "d_model": 32,
    "n_layer": 2,
    "n_head": 4,
    "d_ff": 64,
    "max_seq_len": 16,
    "dropout": 0.0,
}
BACKBONES = {
    "bert": TINY
    | {
        "arch": "encoder",
        "norm_position": "post",
        "embedding_norm": True,
        "activation": "gelu",
        "mlm_head_transform": True,
        "lm_head_bias": True,
        "pooler": True,
        "type_vocab_size": 2,
    },
    "gpt2": TINY | {"arch": "decoder", "position": "learned", "activation": "gelu_tanh"},
    "gpt2-untied": TINY | {"arch": "decoder", "position": "learned", "tie_embeddings": False},
    "llama": TINY | SCORING_ARCHS["llama"],  # grouped-query attention, untied
}


def task_model(name: str, num_labels: int, **kwargs) -> TaskModel:
    torch.manual_seed(0)
    model = TaskModel(
        Transformer(ModelConfig(**BACKBONES[name])), "sequence", num_labels, dropout=0.0, **kwargs
    )
    with torch.no_grad():  # a trained-looking head (ours starts at std 0.02, bias 0)
        for p in model.head.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) inputs without PAD among the real tokens."""
    ids = torch.randint(1, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = mask[2, 3:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize(
    ("name", "num_labels"), [("bert", 3), ("bert", 1), ("gpt2", 2), ("gpt2-untied", 1), ("llama", 3)]
)
def test_exported_sequence_classifier_gives_our_logits(name, num_labels):
    model = task_model(name, num_labels)
    labels = [f"label{i}" for i in range(num_labels)]
    hf = classifier_to_hf(model, labels).eval()
    hf.config.pad_token_id = PAD  # save_hf sets the tokenizer's pad id
    assert type(hf).__name__.endswith("ForSequenceClassification")
    assert hf.config.problem_type == ("regression" if num_labels == 1 else "single_label_classification")
    assert hf.config.id2label == dict(enumerate(labels))
    ids, mask = batch()
    types = torch.zeros_like(ids) if name == "bert" else None
    with torch.no_grad():
        ours = model(ids, mask, types)
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    assert ours.abs().max() > 0.1  # the head is not near zero: a dropped weight would show
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("bert", {"pooling": "first"}, "BertForSequenceClassification classifies BERT's pooler output"),
        ("t5", {}, "T5ForSequenceClassification classifies the decoder's state"),
        ("modernbert", {"pooling": "first"}, "ModernBertForSequenceClassification runs its prediction head"),
    ],
)
def test_heads_transformers_cannot_represent_are_refused_in_one_line(name, kwargs, message):
    if name in ("t5", "modernbert"):
        arch = SCORING_ARCHS["t5"] if name == "t5" else TINY_MODEL["modernbert"]
        backbone = Transformer(ModelConfig(**TINY | arch))
        model = TaskModel(backbone, "sequence", 2, **kwargs)
    else:
        model = task_model(name, 2, **kwargs)
    with pytest.raises(ValueError, match=message) as err:
        classifier_to_hf(model)
    assert "\n" not in str(err.value)
