"""Evaluation during ``fit``: the tasks of ``pretrain evaluate`` scored on the training model itself every
``eval_during_fit.every_n_steps`` optimizer steps, with no export and no second process.

The callback adapts ``pretrain.evaluation`` (which knows nothing of training): it builds an ``LMScorer`` over
the backbone and hands ``evaluate`` a log-likelihood function that shards the token requests over the ranks
(request i on rank i mod W, each scored exactly once), gathers the results in order, and so returns on every
rank what one process would. Under FSDP2 and ZeRO-3 every forward all-gathers parameters, so every rank must
run as many forwards as the busiest one: the ranks agree on that number first (``LMScorer.forward_count``), and
those with fewer then run one-token forwards whose output is dropped.

The trajectory is untouched: the backbone is put in eval mode (dropout off) and back, under ``no_grad``, and
the global RNG states (Python, NumPy, torch CPU and CUDA) are restored afterwards. The last evaluated step is
part of the checkpoint, so a resumed run neither repeats nor skips an evaluation. Logged at the step:
``eval/<task>/<metric>`` (acc, acc_norm, perplexity, ...), ``eval/<task>/truncated``, ``eval/<task>/seconds``,
``eval/core`` (``pretrain.evaluation.metrics.core_score``) and ``eval/seconds`` (the whole evaluation).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from pretrain.config.run import EvalDuringFitConfig
from pretrain.errors import InputError
from pretrain.evaluation.config import EvalConfig, load_tasks
from pretrain.evaluation.models import scorer_from_model
from pretrain.evaluation.runner import evaluate, flat_metrics, summarize
from pretrain.evaluation.scoring import LMScorer, Request
from pretrain.training.callbacks.guards import HangGuard
from pretrain.training.callbacks.host_sync import allowed
from pretrain.training.module import PretrainModule


class InLoopEvaluation(Callback):
    """Scores ``config.tasks`` on ``pl_module.model`` after every ``config.every_n_steps``-th optimizer step."""

    def __init__(self, config: EvalDuringFitConfig, special_tokens: dict[str, str] | None = None):
        self.config, self.special_tokens = config, dict(special_tokens or {})
        spec = EvalConfig(
            tasks=list(config.tasks), data_root=config.data_root, num_fewshot=config.num_fewshot
        )
        self.tasks = load_tasks(
            spec, "eval_during_fit.data_root"
        )  # data validated now, before the Trainer starts
        generation = [t.name for t in self.tasks if t.type == "generation"]
        if generation:
            raise InputError(
                f"eval_during_fit.tasks: {generation} are generation tasks, which are not evaluated during "
                "fit; score them with `pretrain evaluate` on a checkpoint"
            )
        self.last_step = 0  # the optimizer step evaluated last
        self.history: list[dict[str, Any]] = []  # {"step", "results"} of this process's evaluations
        self._scorer: LMScorer | None = None
        self._forwards = 0

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state.get("last_step", 0))

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > self.last_step and step % self.config.every_n_steps == 0:
            with allowed():  # scoring reads its results back by design, on any step (trainer.sync_check)
                self.run(trainer, pl_module)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Evaluate now; log and return the results (equal on every rank)."""
        assert isinstance(pl_module, PretrainModule)  # eval_during_fit is a pretraining run's section
        model = pl_module.model
        was_training = model.training
        states = _rng_states()
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        guards = [cb for cb in callbacks if isinstance(cb, HangGuard)]
        armed = [time.monotonic()]

        def heartbeat() -> None:  # re-arm the hang guard's timer as validation does, at most once a second
            if guards and time.monotonic() - armed[0] > 1.0:
                armed[0] = time.monotonic()
                for guard in guards:
                    guard.on_validation_batch_start(trainer, pl_module)

        scorer = self._scorer_for(pl_module, heartbeat)
        model.eval()
        results: dict[str, Any] = {"results": {}}
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for task in self.tasks:
                    began = time.perf_counter()
                    one = evaluate(
                        scorer,
                        [task],
                        seed=self.config.seed,
                        limit=self.config.limit,
                        score=lambda requests: self._sharded(trainer, scorer, requests),
                    )
                    results["results"] |= one["results"]
                    metrics[f"eval/{task.name}/seconds"] = time.perf_counter() - began
        finally:
            model.train(was_training)
            _restore_rng_states(states)
            for guard in guards:
                guard.on_validation_end(trainer, pl_module)  # evaluation time is not a training batch's
        results |= summarize(results["results"])
        metrics |= flat_metrics(results)
        metrics["eval/seconds"] = time.perf_counter() - start
        self.last_step = trainer.global_step
        self.history.append({"step": self.last_step, "results": results, "metrics": metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.last_step)
        return results

    # ------------------------------------------------------------------------------------------ scoring
    def _scorer_for(self, pl_module: PretrainModule, heartbeat: Any) -> LMScorer:
        """An ``LMScorer`` over the backbone whose every forward is counted (and keeps the hang guard armed)."""
        from tokenizers import Tokenizer

        if self._scorer is None:
            assert pl_module.tokenizer_json is not None  # prepare_run gives a fit's module its tokenizer
            tokenizer = Tokenizer.from_str(pl_module.tokenizer_json)
            self._scorer = scorer_from_model(
                pl_module.model,
                tokenizer,
                eos_token=self.special_tokens.get("eos"),
                special_tokens=self.special_tokens,
                batch_size=self.config.batch_size,
                eval_mode=False,
            )
            self._logits_fns = (self._scorer.logits_fn, self._scorer.packed_logits_fn)

        def counted(fn: Any) -> Any:
            def forward(*args: torch.Tensor) -> torch.Tensor:
                self._forwards += 1
                heartbeat()
                return fn(*args)

            return forward

        padded, packed = self._logits_fns
        self._scorer.logits_fn = counted(padded)
        self._scorer.packed_logits_fn = None if packed is None else counted(packed)  # unpadded scoring
        self._scorer.device = pl_module.device
        return self._scorer

    def _sharded(
        self, trainer: L.Trainer, scorer: LMScorer, requests: Sequence[Request]
    ) -> list[tuple[float, bool]]:
        """``scorer.loglikelihood_tokens`` with request i scored on rank i mod W; the results, in order, on
        every rank."""
        world, rank = trainer.world_size, trainer.global_rank
        if world == 1 or not dist.is_initialized():
            return scorer.loglikelihood_tokens(requests)
        share = requests[rank::world]
        most = torch.tensor(scorer.forward_count(share), device=scorer.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # agreed before any forward: each one is a collective
        self._forwards = 0
        mine = scorer.loglikelihood_tokens(share)
        for _ in range(int(most) - self._forwards):  # keep every rank's collectives (FSDP2, ZeRO-3) in step
            _idle_forward(scorer)
        shards: list[Any] = [None] * world
        dist.all_gather_object(shards, mine)
        out: list[tuple[float, bool]] = [None] * len(requests)  # type: ignore[list-item]
        for r, shard in enumerate(shards):
            out[r::world] = shard
        return out


def _idle_forward(scorer: LMScorer) -> None:
    """One forward of a single pad token (the same parameter all-gathers as any other forward)."""
    one = torch.full((1, 1), scorer.pad_token_id, dtype=torch.long, device=scorer.device)
    args = (one, torch.ones_like(one))
    scorer.logits_fn(*args, *args) if scorer.seq2seq else scorer.logits_fn(*args)


def _rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
