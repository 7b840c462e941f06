"""Recurrent language models (``pretrain.models.rnn``) trained with the ``clm`` objective by truncated
BPTT: the train stream is cut into B parallel streams and batch i+1 continues batch i row by row, the hidden state
carried (detached) between batches and reset every epoch and every validation."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from pretrain.baselines.config import RNNLMBaseline
from pretrain.baselines.data import ensure_prepared, ensure_tokenizer, prepared_dirs, split_tokens
from pretrain.baselines.module import BaselineModule, fit, token_sums
from pretrain.config import OptimConfig, RunConfig, SourceConfig
from pretrain.errors import InputError
from pretrain.models.rnn import RNNLanguageModel
from pretrain.objectives.base import Objective


class StreamBatches(Dataset):
    """Truncated-BPTT batches of a 1-D stream: B parallel streams of ``n = len // B`` tokens; item i holds tokens
    ``[i T, i T + T + 1)`` of every stream -> the objective's batch (clm: inputs and next-token labels)."""

    def __init__(self, tokens: np.ndarray, objective: Objective, seq_len: int, batch_size: int):
        n = len(tokens) // batch_size
        if n < seq_len + 1:
            raise InputError(
                f"a stream of {len(tokens)} tokens gives {batch_size} streams of {n} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; lower data.micro_batch_size or data.seq_len"
            )
        self.streams = torch.from_numpy(tokens[: n * batch_size].reshape(batch_size, n))  # (B, n)
        self.objective, self.seq_len = objective, seq_len

    def __len__(self) -> int:
        return (self.streams.shape[1] - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range for {len(self)} batches")
        start = i * self.seq_len
        tokens = self.streams[:, start : start + self.seq_len + 1]
        return self.objective(tokens, torch.Generator().manual_seed(i))


class StreamDataModule(L.LightningDataModule):
    """Contiguous streams for recurrent language models (see :class:`StreamBatches`); validation in order."""

    def __init__(
        self, train: np.ndarray, val: np.ndarray | None, objective: Objective, seq_len: int, batch_size: int
    ):
        super().__init__()
        self.train_set = StreamBatches(train, objective, seq_len, batch_size)
        self.val_set = None if val is None else StreamBatches(val, objective, seq_len, batch_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_set is None else DataLoader(self.val_set, batch_size=None, shuffle=False)


def lm_forward(model: nn.Module, batch: dict[str, Tensor], cache: Any) -> tuple[Tensor, Any]:
    """Logits of a language model on a stream batch; a recurrent model continues from ``cache`` (detached:
    truncated BPTT) and returns its new state, a transformer reads the batch alone."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if isinstance(model, RNNLanguageModel):
        out = model(**inputs, cache=None if cache is None else cache.detach(), use_cache=True)
        return out.logits, out.cache
    return model(**inputs).logits, None


class LanguageModelModule(BaselineModule):
    """A language model trained with the ``clm`` objective on :class:`StreamDataModule` batches; the state of a
    recurrent model is carried between consecutive batches (:func:`lm_forward`) and reset at every epoch and
    validation start."""

    reports_perplexity = True

    def __init__(self, model: nn.Module, optim: OptimConfig, max_steps: int, objective: Objective):
        super().__init__(model, optim, max_steps, objective)
        self._state: dict[bool, Any] = {True: None, False: None}  # training? -> carried state

    def on_train_epoch_start(self) -> None:
        self._state[True] = None

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._state[False] = None

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits, self._state[training] = lm_forward(self.model, batch, self._state[training])
        labels = batch["labels"]
        flops_per_token = getattr(self.model, "flops_per_token", None)
        if flops_per_token is not None:
            self.flops_per_batch = flops_per_token(labels.shape[1]) * labels.numel()
        return token_sums(logits, labels)


@torch.no_grad()
def stream_perplexity(
    model: nn.Module,
    objective: Objective,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    carry: bool = True,
) -> dict[str, float]:
    """Loss, token accuracy and perplexity of a language model over a whole stream (every
    :class:`StreamBatches` batch), in eval mode; a recurrent state is carried throughout (``carry``) or reset
    every window (the context a transformer of length ``seq_len`` has)."""
    was_training = model.training
    model.eval()
    totals: dict[str, Tensor] = {}
    state = None
    batches = StreamBatches(tokens, objective, seq_len, batch_size)
    for batch in (batches[i] for i in range(len(batches))):
        logits, state = lm_forward(model, batch, state if carry else None)
        for key, value in token_sums(logits, batch["labels"]).items():
            totals[key] = totals.get(key, 0) + value.float()
    model.train(was_training)
    return {**objective.summarize(totals), "tokens": int(totals["num_targets"])}


def lm_objective(run: RunConfig, tokenizer: Tokenizer, vocab_size: int) -> Objective:
    """The ``clm`` objective of the run, checked against the tokenizer (a recurrent LM reads across documents:
    ``pretrain.baselines.run.check_document_mask``)."""
    from pretrain import objectives
    from pretrain.datamodules.tokenizer import check_tokenizer

    if run.objective.name != "clm":
        raise InputError(
            f"language-model baselines train with objective clm, got objective.name={run.objective.name!r}"
        )
    objective = objectives.build("clm", tokenizer, **dict(run.objective.options))
    check_tokenizer(tokenizer, vocab_size, objective.required_tokens, run.tokenizer.special_tokens)
    return objective


def lm_streams(
    run: RunConfig, tokenizer: Tokenizer, validation: SourceConfig | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Train stream (train splits of data.sources) and validation stream (``validation``'s whole text, else the
    sources' val splits; None when there is none or ``limit_val_batches`` is 0)."""
    if any(s.weight != 1.0 for s in run.data.sources):
        raise InputError("a contiguous stream cannot blend corpora by weight; set data.sources[].weight=1.0")
    dirs = prepared_dirs(run, tokenizer)
    train = split_tokens(dirs, "train")
    if run.trainer.limit_val_batches == 0:
        return train, None
    if validation is not None:
        return train, split_tokens([ensure_prepared(validation, tokenizer, 0.0)], "train")
    return train, split_tokens(dirs, "val")


def run_rnn_lm(run: RunConfig, cfg: RNNLMBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    tokenizer = ensure_tokenizer(run)
    objective = lm_objective(run, tokenizer, cfg.model.vocab_size)
    train, val = lm_streams(run, tokenizer, cfg.validation)
    data = StreamDataModule(train, val, objective, run.data.seq_len, run.data.micro_batch_size)
    model = RNNLanguageModel(cfg.model)
    fit(run, resolved, LanguageModelModule(model, run.optim, run.trainer.max_steps, objective), data)
    results: dict[str, float] = {
        "parameters": model.num_params(),
        "train_tokens": run.trainer.max_steps * data.train_set.streams.shape[0] * run.data.seq_len,
    }
    if val is not None:
        metrics = stream_perplexity(model, objective, val, run.data.seq_len, run.data.micro_batch_size)
        results.update({f"val/{k}": v for k, v in metrics.items()})
    return results
