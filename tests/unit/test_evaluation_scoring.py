"""Batched log-likelihood scoring, greedy decoding, rolling perplexity and metrics on our Transformer."""

from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import SCORING_ARCHS

from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation import metrics as M
from pretrain.evaluation.models import scorer_from_model
from pretrain.evaluation.perplexity import disjoint_window, evaluate_perplexity, rolling_token_windows
from pretrain.evaluation.runner import evaluate, format_table
from pretrain.evaluation.scoring import LMScorer
from pretrain.evaluation.tasks import TaskConfig
from pretrain.models.config import ModelConfig
from pretrain.models.generation import generate
from pretrain.models.transformer import Transformer


@pytest.fixture(scope="module")
def corpus(shipped_corpus) -> str:
    return shipped_corpus.read_text(encoding="utf-8")[:60_000]


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text(corpus, encoding="utf-8")
    return train_bpe(path, 400, special_tokens=["<pad>", "<s>", "</s>"])


def tiny(kind: str, dtype=torch.float32, max_seq_len: int = 96) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=416, d_model=64, n_layer=2, n_head=4, max_seq_len=max_seq_len, **SCORING_ARCHS[kind]
    )
    return Transformer(cfg).to(dtype).eval()


def random_pairs(corpus: str, n: int, seed: int = 0, max_context: int = 350) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        start = rng.randrange(0, len(corpus) - 600)
        ctx = corpus[start : start + rng.randrange(1, max_context)]
        words = corpus[start + len(ctx) : start + len(ctx) + 200].split()[: rng.randrange(1, 8)] or ["x"]
        pairs.append((ctx, " " + " ".join(words)))
    return pairs


def direct_loglikelihood(
    model: Transformer, ctx: list[int], cont: list[int], max_length: int
) -> tuple[float, bool]:
    """One unpadded forward of the truncated (context + continuation)[:-1], scored at the continuation."""
    tokens = (ctx + cont)[-(max_length + 1) :]
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0, -len(cont) :].double()
    logprobs = F.log_softmax(logits, dim=-1)
    target = torch.tensor(cont)
    return float(logprobs[torch.arange(len(cont)), target].sum()), bool((logprobs.argmax(-1) == target).all())


# ---------------------------------------------------------------------------------------------- tokenization


def test_encode_pair_moves_trailing_space_and_splits_the_whole_encoding(tokenizer):
    scorer = scorer_from_model(tiny("gpt"), tokenizer)
    ctx, cont = scorer.encode_pair("To be, or not to be: that is the ", "question")
    assert ctx == scorer.encode("To be, or not to be: that is the")
    whole = scorer.encode("To be, or not to be: that is the question")
    assert ctx + cont == whole and cont == whole[len(ctx) :]
    assert cont == scorer.encode_pair("To be, or not to be: that is the", " question")[1]
    eos = tokenizer.token_to_id("</s>")
    assert scorer.encode_pair("", "hello there") == (
        [eos],
        scorer.encode("hello there", add_special_tokens=False),
    )
    assert scorer.encode_pair("  ", "hi") == ([eos], scorer.encode("  hi"))  # only spaces: an empty context


def test_seq2seq_encodes_context_and_continuation_separately(tokenizer):
    scorer = scorer_from_model(tiny("t5"), tokenizer)
    assert scorer.encode_pair("The king ", "is dead") == (
        scorer.encode("The king"),
        scorer.encode(" is dead"),
    )


# ------------------------------------------------------------------------------------------ log-likelihood


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loglikelihood_equals_an_unbatched_forward_including_truncation(kind, tokenizer, corpus):
    model = tiny(kind, torch.float64, max_seq_len=64)
    scorer = scorer_from_model(model, tokenizer, batch_size=8)
    pairs = random_pairs(corpus, 24)
    encoded = [scorer.encode_pair(c, x) for c, x in pairs]
    assert any(len(c) + len(x) > 65 for c, x in encoded)  # some requests are left-truncated
    expected = [direct_loglikelihood(model, c, x, 64) for c, x in encoded]
    got = scorer.loglikelihood(pairs)
    for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected):
        assert ll == pytest.approx(ref_ll, abs=1e-9) and greedy == ref_greedy
    assert len({round(ll, 6) for ll, _ in got}) == len(got)  # real, distinct scores


def test_seq2seq_scores_the_continuation_as_decoder_targets(tokenizer, corpus):
    model = tiny("t5", torch.float64)
    scorer = scorer_from_model(model, tokenizer, batch_size=4)
    pairs = random_pairs(corpus, 6, seed=1)
    for (ctx, cont), (ll, greedy) in zip(pairs, scorer.loglikelihood(pairs)):
        enc, target = scorer.encode_pair(ctx, cont)
        dec = torch.tensor([[0] + target[:-1]])
        with torch.no_grad():
            logits = model(torch.tensor([enc[-scorer.max_length :]]), decoder_input_ids=dec).logits[0]
        logprobs = F.log_softmax(logits, dim=-1)
        assert ll == pytest.approx(
            float(logprobs[torch.arange(len(target)), torch.tensor(target)].sum()), abs=1e-9
        )


@pytest.mark.parametrize(
    ("kind", "dtype", "tol"),
    [
        ("gpt", torch.float32, 1e-5),
        ("gpt", torch.float64, 1e-9),
        ("llama", torch.float64, 1e-9),
        ("t5", torch.float64, 1e-9),
    ],
)
def test_results_do_not_depend_on_batch_size_or_padding_side(kind, dtype, tol, tokenizer, corpus):
    model = tiny(kind, dtype)
    pairs = random_pairs(corpus, 20, seed=2, max_context=200)
    runs = {
        (bs, side): scorer_from_model(model, tokenizer, batch_size=bs, padding_side=side).loglikelihood(pairs)
        for bs, side in ((1, "right"), (16, "right"), (16, "left"))
    }
    reference = runs[(1, "right")]
    for result in runs.values():
        for (ll, greedy), (ref_ll, ref_greedy) in zip(result, reference):
            assert abs(ll - ref_ll) <= tol and greedy == ref_greedy


def counted(*args, inner, seen: list[int]):
    """``inner(*args)``, recording the positions it computes (a seq2seq call's decoder ids included)."""
    decoder = {4: 2, 6: 3}.get(
        len(args)
    )  # logits_fn (enc, mask, dec, mask); packed_logits_fn (enc, docs, pos, dec...)
    seen.append(args[0].numel() + (args[decoder].numel() if decoder is not None else 0))
    return inner(*args)


@pytest.mark.parametrize("kind", ["gpt", "llama", "t5"])
def test_unpadded_scoring_equals_padded_and_computes_fewer_positions(kind, tokenizer, corpus):
    """Requests packed into rows without padding (the default) score as the padded batches do, to 1e-6 in
    float32, computing fewer positions (lm-eval's longest-first order already keeps a batch's padding small)."""
    model = tiny(kind)
    pairs = random_pairs(corpus, 40, seed=3, max_context=120)
    positions: dict[bool, list[int]] = {}
    results = {}
    for unpadded in (False, True):
        scorer = scorer_from_model(model, tokenizer, batch_size=8, unpadded=unpadded)
        seen = positions.setdefault(unpadded, [])
        for name in ("logits_fn", "packed_logits_fn"):
            if getattr(scorer, name) is not None:
                setattr(scorer, name, functools.partial(counted, inner=getattr(scorer, name), seen=seen))
        results[unpadded] = scorer.loglikelihood(pairs)
        assert len(seen) == scorer.forward_count(scorer.encode_requests(pairs))
    for (ll, greedy), (ref_ll, ref_greedy) in zip(results[True], results[False], strict=True):
        assert abs(ll - ref_ll) <= 1e-6 and greedy == ref_greedy
    assert sum(positions[True]) < sum(positions[False])


def test_too_long_continuation_and_fused_continuation_are_rejected(tokenizer):
    scorer = scorer_from_model(tiny("gpt", max_seq_len=8), tokenizer)
    with pytest.raises(ValueError, match="exceeds max_length=8"):
        scorer.loglikelihood_tokens([([1], list(range(5, 15)))])
    words = (" the", " and", " you", " that", " this", " my", " with")
    fused = [w for w in words if len(scorer.encode(w)) == len(scorer.encode(w[:-1])) == 1]
    assert fused, "the test tokenizer should merge a common word into one token"
    with pytest.raises(ValueError, match="encodes to no tokens"):
        scorer.loglikelihood([(fused[0][:-1], fused[0][-1])])


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("kind", ["gpt", "t5"])
def test_greedy_until_matches_generate_and_cuts_at_stop_sequences(kind, tokenizer, corpus):
    model = tiny(kind)
    with torch.no_grad():  # a random T5 always prefers <pad> (its decoder-start token): make it say something
        model.embed.tok.weight[0].zero_()
    scorer = scorer_from_model(model, tokenizer, batch_size=3)
    uncached = LMScorer(**{**scorer.__dict__, "decode_fn": None})  # re-runs logits_fn at every step
    contexts = [corpus[i * 97 : i * 97 + 20 + 13 * i] for i in range(4)]
    free = scorer.greedy_until(contexts, until=[], max_new_tokens=8)
    assert free == uncached.greedy_until(contexts, until=[], max_new_tokens=8)
    for ctx, text in zip(contexts, free):  # reference: the backbone's own KV-cache greedy generation
        ids = torch.tensor([scorer.encode(ctx)])
        if kind == "t5":
            out = generate(
                model, None, 8, greedy=True, eos_token_id=scorer.eos_token_id, encoder_input_ids=ids
            )[0, 1:]
        else:
            out = generate(model, ids, 8, greedy=True, eos_token_id=scorer.eos_token_id)[0, ids.shape[1] :]
        out = out.tolist()
        out = out[: out.index(scorer.eos_token_id)] if scorer.eos_token_id in out else out
        assert text == scorer.decode(out)
    longest = max(range(len(free)), key=lambda i: len(free[i]))
    stop = free[longest][-3:-1]
    cut = scorer.greedy_until(contexts[longest : longest + 1], until=["zzz", stop], max_new_tokens=8)[0]
    assert cut == free[longest].split(stop)[0] and len(cut) < len(free[longest])


# ---------------------------------------------------------------------------------------------- perplexity


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 60), max_seq_len=st.integers(1, 16), data=st.data())
def test_rolling_windows_predict_every_token_once_with_bounded_inputs(n, max_seq_len, data):
    context_len = data.draw(st.integers(1, max_seq_len))
    tokens = list(range(100, 100 + n))
    windows = list(rolling_token_windows(tokens, -1, max_seq_len, context_len))
    assert [t for _, pred in windows for t in pred] == tokens
    for inputs, pred in windows:
        assert len(inputs) <= max_seq_len and len(pred) <= len(inputs)
        ctx, cont = disjoint_window((inputs, pred))
        full = [-1] + tokens
        end = full.index(pred[-1])  # the input ends just before the last predicted token
        assert ctx + cont[:-1] == full[end - len(ctx) - len(cont) + 1 : end]


def test_rolling_loglikelihood_scores_disjoint_windows(tokenizer, corpus):
    model = tiny("gpt", torch.float64)
    text = corpus[:150]
    full_scorer = scorer_from_model(model, tokenizer)
    tokens = full_scorer.encode(text)
    full = [full_scorer.prefix_token_id] + tokens

    def expected(window: int) -> float:
        """Window k predicts tokens[k*W : (k+1)*W] (context_len=1), reading the W tokens before its last."""
        total = 0.0
        for start in range(0, len(tokens), window):
            end = min(start + window, len(tokens))
            inputs, targets = full[max(0, end - window) : end], tokens[start:end]
            with torch.no_grad():
                logits = model(torch.tensor([inputs])).logits[0, -len(targets) :]
            total += float(F.log_softmax(logits, -1)[torch.arange(len(targets)), torch.tensor(targets)].sum())
        return total

    assert len(tokens) < full_scorer.max_length
    metrics, records = evaluate_perplexity(full_scorer, [text])
    assert records[0]["loglikelihood"] == pytest.approx(expected(len(tokens)), abs=1e-9)
    assert metrics["bits_per_byte"] == pytest.approx(
        -expected(len(tokens)) / len(text.encode()) / math.log(2)
    )
    assert metrics["token_perplexity"] == pytest.approx(math.exp(-expected(len(tokens)) / len(tokens)))
    _, windowed = evaluate_perplexity(
        scorer_from_model(model, tokenizer, max_length=16, batch_size=3), [text]
    )
    assert windowed[0]["loglikelihood"] == pytest.approx(expected(16), abs=1e-9)
    assert expected(16) != pytest.approx(expected(len(tokens)))


# ---------------------------------------------------------------------------------------- metrics + runner


def test_acc_norm_divides_by_choice_length_in_characters():
    lls, choices = [-10.0, -12.0], ["short", "a much longer choice"]
    assert M.multiple_choice_metrics(lls, choices, gold=1) == {"acc": 0.0, "acc_norm": 1.0}
    assert M.mean_stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(math.sqrt(0.25 / 4))
    assert M.exact_match(" Paris\n", ["paris", "France"], strip=True, ignore_case=True) == 1.0
    assert M.exact_match(" Paris", "Paris", strip=False, ignore_case=False) == 0.0


def test_runner_reports_every_task_type(tokenizer, corpus, tmp_path):
    scorer = scorer_from_model(tiny("gpt"), tokenizer, batch_size=4)
    lines = [ln for ln in corpus.splitlines() if len(ln.split()) > 4][:12]
    rows = {
        "multiple_choice": [
            {"query": ln, "choices": ["yes", "no, my lord"], "gold": i % 2} for i, ln in enumerate(lines)
        ],
        "schema": [{"context_options": [ln, ln.upper()], "continuation": "thee.", "gold": 0} for ln in lines],
        "language_modeling": [
            {"context": " ".join(ln.split()[:-1]), "continuation": ln.split()[-1]} for ln in lines
        ],
        "generation": [{"context": ln, "answer": ln} for ln in lines],
    }
    tasks = []
    for kind, examples in rows.items():
        path = tmp_path / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in examples))
        tasks.append(TaskConfig(name=kind, type=kind, path=str(path), num_fewshot=1, max_new_tokens=4))
    (tmp_path / "text.txt").write_text(corpus[:3000])
    tasks.append(TaskConfig(name="ppl", type="perplexity", path=str(tmp_path / "text.txt")))
    results = evaluate(scorer, tasks, seed=5, limit=10, log_samples=True)
    for task in tasks:
        res = results["results"][task.name]
        assert set(res["metrics"]) == set(task.metric_names)
        assert res["num_examples"] == (1 if task.type == "perplexity" else 10) and res["seed"] == 5
    first = results["samples"]["multiple_choice"][0]
    assert scorer.loglikelihood([(first["context"], " yes")])[0][0] == pytest.approx(
        first["loglikelihoods"][0], abs=1e-5
    )
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in format_table(results).splitlines()[2:]
    ]
    mc = results["results"]["multiple_choice"]
    value, se = mc["metrics"]["acc_norm"], mc["stderr"]["acc_norm"]
    assert [
        "multiple_choice",
        "multiple_choice",
        "1",
        "10",
        "5",
        "acc_norm",
        f"{value:.4f}",
        f"{se:.4f}",
    ] in rows
    assert ["ppl", "perplexity", "0", "1", "5", "bits_per_byte"] in [r[:6] for r in rows] and rows[-1][
        -1
    ] == "N/A"
    assert results["results"]["generation"]["metrics"]["exact_match"] == 0.0  # 4 tokens cannot copy a line
    assert all(len(s["prediction"]) > 0 for s in results["samples"]["generation"])
