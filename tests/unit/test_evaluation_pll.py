"""Encoder-only scoring: pseudo-log-likelihood (Salazar et al. 2020) against the same formula computed through
transformers' ``BertForMaskedLM`` on the exported weights, in ``evaluate`` and ``pretrain evaluate``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pretrain.cli import main as cli_main
from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.models import load_scorer, scorer_from_model
from pretrain.evaluation.runner import evaluate
from pretrain.evaluation.scoring import UnsupportedModelError
from pretrain.evaluation.tasks import TaskConfig
from pretrain.models.config import ModelConfig
from pretrain.models.hf import hf_tokenizer, save_hf
from pretrain.models.transformer import Transformer

BERT = {
    "arch": "encoder",
    "norm_position": "post",
    "embedding_norm": True,
    "activation": "gelu",
    "mlm_head_transform": True,
    "lm_head_bias": True,
    "init": "bert",
    "type_vocab_size": 2,
}
PAIRS = [
    ("To be, or not to be: that is the", " question"),
    ("First Citizen: Before we proceed any further, hear me", " speak."),
    ("", "All: Speak, speak."),
    ("You are all resolved rather to die than to famish? All: Resolved. resolved. First Citizen:", " First"),
]


@pytest.fixture(scope="module")
def world(shipped_corpus, tmp_path_factory):
    """(our BERT, tokenizer, transformers directory written by ``save_hf``)."""
    tmp = tmp_path_factory.mktemp("pll")
    (tmp / "corpus.txt").write_text(shipped_corpus.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    tokenizer = train_bpe(tmp / "corpus.txt", 400)  # every special token: <mask>, <cls>, <sep>, ...
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=448, d_model=32, n_layer=2, n_head=2, d_ff=64, max_seq_len=24, **BERT)
    model = Transformer(cfg).eval()
    # save_hf(model, dir, tokenizer) fails for BertForMaskedLM (set_token_ids reads its missing
    # generation_config): weights and tokenizer files written apart
    hf_dir = save_hf(model, tmp / "hf")
    hf_tokenizer(tokenizer, cfg.max_seq_len).save_pretrained(hf_dir)
    return model, tokenizer, hf_dir


def reference_pll(
    hf_model, tokenizer, ctx: list[int], cont: list[int], max_length: int
) -> tuple[float, bool]:
    """Salazar et al.'s PLL through transformers: [CLS] tokens [SEP], each continuation token masked in turn."""
    ids = {t: tokenizer.token_to_id(t) for t in ("<cls>", "<sep>", "<mask>")}
    seq = [ids["<cls>"], *(ctx + cont)[-(max_length - 2) :], ids["<sep>"]]
    total, greedy = 0.0, True
    for pos in range(len(seq) - 1 - len(cont), len(seq) - 1):
        masked = torch.tensor([seq[:pos] + [ids["<mask>"]] + seq[pos + 1 :]])
        with torch.no_grad():
            logprobs = F.log_softmax(hf_model(input_ids=masked).logits[0, pos].double(), -1)
        total += float(logprobs[seq[pos]])
        greedy &= int(logprobs.argmax()) == seq[pos]
    return total, greedy


def test_pseudo_loglikelihood_equals_bert_for_masked_lm_on_the_export(world):
    import transformers

    model, tokenizer, hf_dir = world
    hf_model = transformers.BertForMaskedLM.from_pretrained(hf_dir).eval()
    ours = scorer_from_model(model, tokenizer, batch_size=3)  # rows of different requests share batches
    exported = load_scorer(hf_dir, batch_size=5)  # the export read back, special tokens from its files
    requests = ours.encode_requests(PAIRS)
    too_long = [len(c) + len(x) > 24 - 2 for c, x in requests]  # [CLS] and [SEP] take two of 24 positions
    assert ours.truncated(requests) == sum(too_long) and too_long[-1] and not all(too_long)
    for scorer in (ours, exported):  # (the export conditions an empty context on its declared BOS)
        expected = [reference_pll(hf_model, tokenizer, c, x, 24) for c, x in scorer.encode_requests(PAIRS)]
        for (ll, greedy), (ref_ll, ref_greedy) in zip(scorer.loglikelihood(PAIRS), expected, strict=True):
            assert ll == pytest.approx(ref_ll, abs=1e-6) and greedy == ref_greedy
    assert (
        expected[-1][0]
        != pytest.approx(  # the truncation rule matters: the whole context differs
            reference_pll(hf_model, tokenizer, requests[-1][0][-3:], requests[-1][1], 24)[0], abs=1e-3
        )
    )


def test_encoder_scores_multiple_choice_and_perplexity_tasks_through_the_cli(world, tmp_path):
    model, tokenizer, hf_dir = world
    mc = tmp_path / "mc.jsonl"
    items = [{"query": q, "choices": ["yes", "no", "maybe"], "gold": i % 3} for i, (q, _) in enumerate(PAIRS)]
    mc.write_text("".join(json.dumps(x) + "\n" for x in items))
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": " ".join(c + x for c, x in PAIRS)}) + "\n")
    tasks = [
        TaskConfig(name="mc", type="multiple_choice", path=str(mc)),
        TaskConfig(name="ppl", type="perplexity", path=str(text)),
    ]
    scorer = scorer_from_model(model, tokenizer)
    results = evaluate(scorer, tasks, log_samples=True)
    first = results["samples"]["mc"][0]  # each choice's score is its PLL given the query
    lls = [ll for ll, _ in scorer.loglikelihood([(PAIRS[0][0], " " + c) for c in items[0]["choices"]])]
    assert first["loglikelihoods"] == lls
    assert results["results"]["mc"]["chance"] == pytest.approx(1 / 3)
    assert results["core"] == pytest.approx((results["results"]["mc"]["metrics"]["acc"] - 1 / 3) / (2 / 3))
    ppl = results["results"]["ppl"]["metrics"]["token_perplexity"]
    n_tokens = results["samples"]["ppl"][0]["tokens"]
    assert n_tokens > scorer.window_length  # several windows
    assert ppl == pytest.approx(
        torch.exp(-torch.tensor(results["samples"]["ppl"][0]["loglikelihood"]) / n_tokens)
    )

    for i, name in enumerate(("mc", "ppl")):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: {name}\ntype: {tasks[i].type}\npath: {tasks[i].path}\n"
        )
    out = tmp_path / "results.json"
    tasks_arg = f"{tmp_path / 'mc.yaml'},{tmp_path / 'ppl.yaml'}"
    assert (
        cli_main(["evaluate", str(hf_dir), "--tasks", tasks_arg, "--output", str(out), "--device", "cpu"])
        == 0
    )
    cli = json.loads(out.read_text())["results"]
    assert cli["mc"]["metrics"] == pytest.approx(results["results"]["mc"]["metrics"], abs=1e-6)
    assert cli["ppl"]["metrics"] == pytest.approx(results["results"]["ppl"]["metrics"], rel=1e-4)


def test_encoder_refuses_generation(world):
    model, tokenizer, _ = world
    with pytest.raises(UnsupportedModelError, match="does not generate"):
        scorer_from_model(model, tokenizer).greedy_until(["To be"], ["\n"], 4)
