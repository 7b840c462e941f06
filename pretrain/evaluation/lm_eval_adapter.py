"""lm-evaluation-harness model adapter: run lm-eval's own tasks on our checkpoints (optional ``lm-eval``).

Importing this module registers the model under the name ``"pretrain"``::

    import lm_eval
    import pretrain.evaluation.lm_eval_adapter  # noqa: F401  (registers "pretrain")

    lm_eval.simple_evaluate(model="pretrain", model_args="checkpoint=runs/gpt-tiny,batch_size=16",
                            tasks=["lambada_openai", "hellaswag"])

or pass an instance: ``simple_evaluate(model=PretrainLM(scorer=...), ...)``. Tokenization (``tok_encode``
through lm-eval's ``TemplateLM._encode_pair``) and scoring share ``LMScorer``'s code with
``pretrain evaluate``, so both routes give the same numbers.
"""

from __future__ import annotations

from typing import Any

from pretrain.errors import InputError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the lm-eval adapter needs lm-evaluation-harness: pip install 'lm-eval>=0.4.13'"
    ) from err

from .models import load_scorer
from .perplexity import loglikelihood_rolling
from .scoring import LMScorer


@register_model("pretrain")
class PretrainLM(TemplateLM):
    """lm-eval ``LM`` over an ``LMScorer`` (built from ``checkpoint`` unless ``scorer`` is given)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        scorer: LMScorer | None = None,
        batch_size: int | str = 16,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int | None = None,
        prefix_token: str | None = None,
        max_gen_toks: int = 256,
        **unused: Any,  # lm-eval passes e.g. max_batch_size
    ) -> None:
        super().__init__()
        if scorer is None:
            if checkpoint is None:
                raise InputError("PretrainLM needs checkpoint=<path> (model_args) or scorer=<LMScorer>")
            if str(batch_size).startswith("auto"):
                raise InputError("batch_size=auto is not supported by the pretrain adapter; give an integer")
            scorer = load_scorer(
                checkpoint,
                tokenizer,
                device=device,
                dtype=dtype,
                prefix_token=prefix_token,
                max_length=int(max_length) if max_length else None,
                batch_size=int(batch_size),
            )
        self.scorer = scorer
        self.backend = "seq2seq" if scorer.seq2seq else "causal"
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return (
            self.scorer.eos_token_id if self.scorer.eos_token_id is not None else self.scorer.prefix_token_id
        )

    @property
    def prefix_token_id(self) -> int:
        return self.scorer.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.scorer.encode(
            string, add_special_tokens=True if add_special_tokens is None else add_special_tokens
        )

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.scorer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood_tokens([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [ll for ll, _ in loglikelihood_rolling(self.scorer, [req.args[0] for req in requests])]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding only; requests are grouped by their generation arguments."""
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kwargs: dict[str, Any] = dict(req.args[1])
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0.0:
                raise InputError(
                    "the pretrain adapter decodes greedily; set do_sample: false / temperature: 0"
                )
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks)))
            groups.setdefault((tuple(until), max_new), []).append(i)
        outputs: list[str] = [""] * len(requests)
        for (until, max_new), indices in groups.items():
            texts = self.scorer.greedy_until([requests[i].args[0] for i in indices], list(until), max_new)
            for i, text in zip(indices, texts):
                outputs[i] = text
        return outputs
