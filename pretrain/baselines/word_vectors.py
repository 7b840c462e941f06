"""Word-vector baselines: SGNS / CBOW (``pretrain.objectives.sgns``) on the prepared corpus through
``PretrainDataModule``, GloVe (``pretrain.objectives.glove``) on the co-occurrence matrix of the train split; neighbours,
analogies, similarity and word2vec export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from pretrain.baselines.config import GloVeBaseline, SGNSBaseline, WordEvalConfig
from pretrain.baselines.data import ensure_tokenizer, prepared_dirs, split_tokens
from pretrain.baselines.module import BaselineModule, fit, val_metrics
from pretrain.config import RunConfig
from pretrain.models.word_vectors import (
    GloVeModel,
    Word2Vec,
    WordVectors,
    read_analogies,
    read_similarity,
)
from pretrain.objectives.glove import Cooccurrence, GloVe
from pretrain.objectives.sgns import SkipGram, token_counts


class IndexBatches(Dataset):
    """Item = a list of indices -> the batch of those rows (batched indexing, no per-row Python)."""

    def __init__(self, make: Any, size: int):
        self.make, self.size = make, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: list[int]) -> Any:
        return self.make(torch.as_tensor(index))


def index_loader(make: Any, size: int, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Batches of ``make(indices)`` over ``range(size)``, shuffled every epoch by a seeded generator."""
    base = (
        RandomSampler(range(size), generator=torch.Generator().manual_seed(seed))
        if shuffle
        else SequentialSampler(range(size))
    )
    sampler = BatchSampler(base, batch_size, drop_last=False)
    return DataLoader(IndexBatches(make, size), sampler=sampler, batch_size=None)


class CooccurrenceData(L.LightningDataModule):
    """GloVe training batches: shuffled non-zero entries ``(input_ids=i, context_ids=j, counts=X_ij)``;
    validation = every entry in order (the objective over the whole matrix)."""

    def __init__(self, x: Cooccurrence, batch_size: int, seed: int):
        super().__init__()
        self.x, self.batch_size, self.seed = x, batch_size, seed

    def _batch(self, index: Tensor) -> dict[str, Tensor]:
        return {
            "input_ids": self.x.rows[index],
            "context_ids": self.x.cols[index],
            "counts": self.x.values[index],
        }

    def train_dataloader(self) -> DataLoader:
        return index_loader(self._batch, len(self.x.values), self.batch_size, True, self.seed)

    def val_dataloader(self) -> DataLoader:
        return index_loader(self._batch, len(self.x.values), 16 * self.batch_size, False, self.seed)


class WordVectorModule(BaselineModule):
    """Word2vec trained with a :class:`pretrain.objectives.sgns.SkipGram` objective's batches and loss."""

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        logits = self.model(batch["input_ids"], batch["input_mask"], batch.get("candidates"))
        loss_sum, num_targets = self.objective.loss(logits, batch["labels"])
        correct = self.objective.metrics(logits.detach(), batch["labels"])["num_correct"]
        return {"loss_sum": loss_sum, "num_targets": num_targets, "num_correct": correct}


class GloVeModule(BaselineModule):
    """GloVe's weighted least squares (:class:`pretrain.objectives.glove.GloVe`) on co-occurrence entries."""

    def sums(self, batch: dict[str, Tensor], training: bool) -> dict[str, Tensor]:
        prediction = self.model(batch["input_ids"], batch["context_ids"])
        return dict(zip(("loss_sum", "num_targets"), self.objective.loss(prediction, batch["counts"])))


def evaluate_word_vectors(vectors: WordVectors, cfg: WordEvalConfig, out_dir: Path) -> dict[str, Any]:
    """Neighbours of the queries, analogy accuracy and similarity correlation when files are given; export."""
    results: dict[str, Any] = {"vocabulary": len(vectors)}
    known = [q for q in cfg.queries if vectors.lookup(q) is not None]
    results["neighbours"] = {q: vectors.nearest(q, cfg.neighbours) for q in known}
    results["unknown_queries"] = [q for q in cfg.queries if q not in known]
    if cfg.analogies:
        results.update(vectors.analogy_accuracy(read_analogies(cfg.analogies)))
    if cfg.similarity:
        results.update(vectors.similarity_correlation(read_similarity(cfg.similarity)))
    if cfg.export:
        results["vectors"] = str(vectors.save_word2vec(out_dir / "vectors.txt"))
    return results


def word_vocabulary(tokenizer: Tokenizer, vocab: Tensor) -> list[int]:
    """Ids to report: the vocabulary minus tokens whose string holds whitespace (not writable as word2vec text)."""
    return [
        i
        for i in vocab.nonzero()[:, 0].tolist()
        if not any(ch.isspace() for ch in tokenizer.id_to_token(i) or "")
    ]


def run_sgns(run: RunConfig, cfg: SGNSBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    from pretrain.datamodules.pretrain import PretrainDataModule

    tokenizer = ensure_tokenizer(run)
    dirs = prepared_dirs(run, tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    objective = SkipGram(
        tokenizer,
        counts=token_counts(split_tokens(dirs, "train"), vocab_size),
        window=cfg.window,
        negatives=cfg.negatives,
        subsample=cfg.subsample,
        min_count=cfg.min_count,
        cbow=cfg.cbow,
        full_softmax=cfg.full_softmax,
        noise_power=cfg.noise_power,
        special_tokens=run.tokenizer.special_tokens,
    )
    data = PretrainDataModule(
        dirs,
        objective,
        seq_len=run.data.seq_len,
        micro_batch_size=run.data.micro_batch_size,
        weights=[s.weight for s in run.data.sources],
        num_workers=run.data.num_workers,
        seed=run.seed,
        val_batches=run.trainer.limit_val_batches,
        tokenizer=tokenizer,
    )
    model = Word2Vec(vocab_size, cfg.dim)
    trainer = fit(run, resolved, WordVectorModule(model, run.optim, run.trainer.max_steps, objective), data)
    vectors = WordVectors.from_ids(model.vectors(), tokenizer, word_vocabulary(tokenizer, objective.vocab))
    return {**val_metrics(trainer), **evaluate_word_vectors(vectors, cfg.eval, run.run_path)}


def run_glove(run: RunConfig, cfg: GloVeBaseline, resolved: dict[str, Any]) -> dict[str, Any]:
    tokenizer = ensure_tokenizer(run)
    dirs = prepared_dirs(run, tokenizer)
    objective = GloVe(
        tokenizer,
        window=cfg.window,
        min_count=cfg.min_count,
        x_max=cfg.x_max,
        alpha=cfg.alpha,
        symmetric=cfg.symmetric,
        special_tokens=run.tokenizer.special_tokens,
    )
    x = objective.count(split_tokens(dirs, "train"))
    model = GloVeModel(tokenizer.get_vocab_size(with_added_tokens=True), cfg.dim)
    module = GloVeModule(model, run.optim, run.trainer.max_steps, objective)
    trainer = fit(run, resolved, module, CooccurrenceData(x, cfg.batch_size, run.seed))
    vectors = WordVectors.from_ids(model.vectors(), tokenizer, word_vocabulary(tokenizer, x.vocab))
    results = {"cooccurrence_entries": len(x.values), **val_metrics(trainer)}
    return {**results, **evaluate_word_vectors(vectors, cfg.eval, run.run_path)}
