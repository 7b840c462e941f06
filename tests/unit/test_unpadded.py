"""Unpadded finetuning batches (``datamodules/unpadded.py``): packed rows compute fewer positions and give the padded
path's logits, losses and gradients (1e-6, float32) for classification (every pooling), regression and
text-to-text; first-fit packing keeps every row within its capacity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_data import corpus_paragraphs, tiny_model_config, tiny_tokenizer

from pretrain.datamodules.finetune import FinetuneDataModule, PackedCollate, PaddingCollate
from pretrain.datamodules.text2text import PackedText2TextCollate, Text2TextCollate, Text2TextDataModule
from pretrain.datamodules.unpadded import first_fit
from pretrain.finetuning.module import PACKED_TEXT2TEXT_KEYS
from pretrain.models.config import ModelConfig
from pretrain.models.heads import Packing, TaskModel
from pretrain.models.transformer import Transformer

BACKBONES = {  # arch, pooling
    "bert-first": ("encoder", "first"),
    "bert-pooler": ("encoder", "pooler"),
    "bert-mean": ("encoder", "mean"),
    "gpt-last": ("decoder", "last"),
    "t5-mean": ("encoder-decoder", "mean"),
}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 9)), min_size=1, max_size=30))
def test_first_fit_rows_hold_every_example_once_within_capacity(sizes):
    capacity = [max(s[0] for s in sizes), max(s[1] for s in sizes)]
    rows = first_fit(sizes, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
    for row in rows:
        assert all(sum(sizes[i][k] for i in row) <= capacity[k] for k in range(2))


def examples(tmp_path, regression: bool = False, n: int = 24) -> list:
    texts = [
        p.replace("\n", " ").replace("\t", " ")[: 8 + 9 * (i % 7)]
        for i, p in enumerate(corpus_paragraphs()[:n])
    ]
    labels = [f"{(i % 5) / 2:.1f}" if regression else str(i % 3) for i in range(n)]
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in zip(texts, labels, strict=True)))
    data = FinetuneDataModule(
        tiny_tokenizer(), path, text_columns=["sentence"], label_column="label", regression=regression
    )
    data.setup("fit")
    return data.examples["train"]


def task_model(arch: str, pooling: str, num_labels: int) -> TaskModel:
    torch.manual_seed(0)
    config = tiny_model_config(
        arch,
        position="relative" if arch == "encoder-decoder" else "learned",
        pooler=pooling == "pooler",
        type_vocab_size=2 if arch == "encoder" else 0,
    )
    return TaskModel(Transformer(config), "sequence", num_labels, pooling=pooling, dropout=0.0)


def forward(model: TaskModel, batch: dict) -> torch.Tensor:
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], Packing.of(batch))


@pytest.mark.parametrize("name", list(BACKBONES))
@pytest.mark.parametrize("regression", [False, True])
def test_packed_classification_equals_padded(tmp_path, name, regression):
    batch_examples = examples(tmp_path, regression)
    model = task_model(*BACKBONES[name], 1 if regression else 3)
    padded, packed = (c(0, regression)(batch_examples) for c in (PaddingCollate, PackedCollate))
    assert packed["input_ids"].numel() < 0.75 * padded["input_ids"].numel()  # positions computed
    assert (packed["attention_mask"] > 0).sum() == (padded["attention_mask"] > 0).sum()  # every real token
    losses = []
    for batch in (padded, packed):
        model.zero_grad(set_to_none=True)
        logits = forward(model, batch)
        if regression:
            loss = torch.nn.functional.mse_loss(logits.squeeze(-1), batch["labels"])
        else:
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        loss.backward()
        losses.append(
            (
                logits.detach(),
                loss.detach(),
                [p.grad.clone() for p in model.parameters() if p.grad is not None],
            )
        )
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = losses
    torch.testing.assert_close(logits_b, logits_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("regression", [False, True])
def test_finetune_validation_metrics_equal_padded(tmp_path, regression):
    """``FinetuneModule``'s validation (loss and every metric, over batches of 8 with evaluation padding rows)
    gives the same values on packed batches as on padded ones (1e-6)."""
    from dataclasses import replace

    from pretrain.datamodules.finetune import MarkPadding, Padding
    from pretrain.finetuning.config import FinetuneConfig
    from pretrain.finetuning.module import FinetuneModule

    batch_examples = examples(tmp_path, regression)[:21]
    batch_examples += [Padding((batch_examples[j],)) for j in range(3)]  # a sharded evaluation's last batch
    names = ["pearson", "spearman"] if regression else ["accuracy", "f1", "mcc"]
    values = []
    for collate in (PaddingCollate, PackedCollate):
        model = task_model("encoder", "mean", 1 if regression else 3)
        cfg = replace(FinetuneConfig(), metrics=names)
        module = FinetuneModule(model, cfg, num_labels=3, regression=regression).eval()
        wrap = MarkPadding(collate(0, regression))
        with torch.no_grad():
            for i in range(0, len(batch_examples), 8):
                module.validation_step(wrap(batch_examples[i : i + 8]), i)
        computed = {k: float(v) for k, v in module.metrics.compute().items()}
        values.append(computed | {"loss": float(module.val_loss.compute())})
    padded, packed = values
    assert padded.keys() == packed.keys() == set(names) | {"loss"}
    for name, value in padded.items():
        assert abs(packed[name] - value) <= 1e-6, (name, packed[name], value)


def test_packed_text2text_loss_equals_padded():
    tok = tiny_tokenizer()
    pad, eos = tok.token_to_id("<pad>"), tok.token_to_id("</s>")
    texts = [p.replace("\n", " ") for p in corpus_paragraphs()[:20]]
    pairs = [(t[: 10 + 7 * (i % 6)], t[-(3 + 5 * (i % 4)) :]) for i, t in enumerate(texts)]
    data = Text2TextDataModule(tok, pairs, pad_id=pad, eos_id=eos, decoder_start_id=pad)
    data.setup("fit")
    batch_examples = data.examples["train"]
    torch.manual_seed(0)
    config = ModelConfig(
        arch="encoder-decoder",
        vocab_size=tok.get_vocab_size(),
        d_model=32,
        n_layer=2,
        n_head=2,
        d_ff=64,
        max_seq_len=128,
        position="relative",
        decoder_start_token_id=pad,
    )
    model = Transformer(config)
    padded = Text2TextCollate(pad, pad)(batch_examples)
    packed = PackedText2TextCollate(pad, pad)(batch_examples)
    assert packed["input_ids"].numel() + packed["labels"].numel() < 0.8 * (
        padded["input_ids"].numel() + padded["labels"].numel()
    )
    results = []
    for batch in (padded, packed):
        model.zero_grad(set_to_none=True)
        extra = {k: batch[k] for k in PACKED_TEXT2TEXT_KEYS if k in batch}
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
            **extra,
        ).logits
        labels = batch["labels"]
        per_token = torch.nn.functional.cross_entropy(
            logits[labels != -100], labels[labels != -100], reduction="none"
        )
        per_token.mean().backward()
        order = batch["labels"] != -100
        results.append(
            (per_token.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], order)
        )
    (a, grads_a, _), (b, grads_b, _) = results
    # the same targets in another order: compare the multisets of per-token losses, the mean, the gradients
    torch.testing.assert_close(b.sort().values, a.sort().values, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.mean(), a.mean(), rtol=1e-6, atol=0)
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
