"""Few-shot prompts longer than the model's context: cut from the left keeping the continuation (lm-eval
0.4.13's ``HFLM._loglikelihood_tokens``), counted per task and reported."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.config import EvalConfig
from pretrain.evaluation.models import scorer_from_model
from pretrain.evaluation.runner import evaluate, run_evaluation
from pretrain.evaluation.tasks import TaskConfig
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer


@pytest.fixture(scope="module")
def setup(shipped_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trunc")
    lines = [
        line for line in shipped_corpus.read_text(encoding="utf-8")[:20_000].splitlines() if line.strip()
    ]
    (tmp / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    tokenizer = train_bpe(tmp / "corpus.txt", 320, special_tokens=["<pad>", "<s>", "</s>"])
    items = [
        {"query": lines[i], "choices": [" " + lines[i + 1][:12], " no"], "gold": 0} for i in range(0, 40, 2)
    ]
    path = tmp / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", vocab_size=320, d_model=32, n_layer=1, n_head=2, max_seq_len=48)
    model = Transformer(cfg)
    ckpt = tmp / "last.ckpt"
    payload = {"config": {"model": cfg.__dict__, "tokenizer": {}}, "tokenizer_json": tokenizer.to_str()}
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "pretrain": payload}, ckpt
    )
    return model, tokenizer, path, ckpt


def test_prompts_beyond_the_context_are_counted_and_reported(setup, capsys, tmp_path):
    model, tokenizer, path, ckpt = setup
    scorer = scorer_from_model(model, tokenizer)
    for shots in (0, 3):
        task = TaskConfig(name="mc", type="multiple_choice", path=str(path), num_fewshot=shots)
        results = evaluate(scorer, [task], log_samples=True)
        choices = [json.loads(line)["choices"] for line in path.read_text().splitlines()]
        too_long = sum(  # recount from the prompts: context + continuation beyond max_length + 1 tokens
            any(
                sum(map(len, scorer.encode_pair(r["context"], " " + c))) > 48 + 1
                for c in choices[r["doc_id"]]
            )
            for r in results["samples"]["mc"]
        )
        assert results["results"]["mc"]["truncated"] == too_long
        assert (too_long == 0) == (shots == 0)  # one-line queries fit; three shots do not
    run_evaluation(EvalConfig(checkpoint=str(ckpt), tasks=[str(_task_yaml(tmp_path, path))], num_fewshot=3))
    out = capsys.readouterr().out
    assert (
        f"warning: mc: {too_long} of 20 prompts longer than the model's 48 tokens were cut from the left"
        in out
    )


def test_truncated_request_scores_as_lm_eval_cuts_it(setup):
    model, tokenizer, _, _ = setup
    scorer = scorer_from_model(model, tokenizer)
    ctx, cont = list(range(10, 70)), [5, 6, 7]  # 63 tokens for a 48-token model
    kept = (ctx + cont)[-49:]  # lm-eval: (context_enc + continuation_enc)[-(max_length + 1):][:-1]
    assert scorer.truncated([(ctx, cont)]) == 1 and scorer.truncated([(kept[:-3], cont)]) == 0
    assert scorer.loglikelihood_tokens([(ctx, cont)]) == scorer.loglikelihood_tokens([(kept[:-3], cont)])


def _task_yaml(directory, path):
    task = directory / "mc.yaml"
    task.write_text(f"name: mc\ntype: multiple_choice\npath: {path}\nnum_fewshot: 0\n")
    return task
