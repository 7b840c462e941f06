"""Parity with lm-evaluation-harness, run locally and offline on the same exported weights.

lm-eval's ``hf`` model reads a random GPT-2 / Llama / T5 that we export with ``pretrain.models.hf.save_hf`` (plus a
local tokenizer), on task YAMLs pointing at local JSONL files; our evaluator reads the same directory through
``pretrain.models.hf.from_hf``. Metrics (acc, acc_norm, perplexities, exact match) must be equal and every
per-example log-likelihood must agree to float32 precision.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import lm_eval
import pytest
import torch
import yaml
from model_zoo import SCORING_ARCHS

from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.config import resolve_task_file
from pretrain.evaluation.models import load_scorer
from pretrain.evaluation.runner import evaluate
from pretrain.evaluation.tasks import TaskConfig, load_task
from pretrain.models.config import ModelConfig
from pretrain.models.hf import save_hf
from pretrain.models.transformer import Transformer

LM_EVAL_METRICS = {
    "multiple_choice": ["acc", "acc_norm"],
    "schema": ["acc"],
    "language_modeling": ["perplexity", "acc"],
    "perplexity": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    "generation": ["exact_match"],
}


def lm_eval_task(task: TaskConfig, cache: Path) -> dict:
    """The lm-eval YAML for one of our tasks (same file, shots, delimiters)."""
    spec = {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": task.path}, "cache_dir": str(cache)},
        "test_split": "test",
        "fewshot_split": "test",
        "num_fewshot": task.num_fewshot,
        "target_delimiter": task.target_delimiter,
        "fewshot_delimiter": task.fewshot_delimiter,
        "metric_list": [{"metric": m} for m in LM_EVAL_METRICS[task.type]],
    }
    if task.type == "multiple_choice":
        spec.update(
            output_type="multiple_choice", doc_to_text="query", doc_to_target="gold", doc_to_choice="choices"
        )
    elif task.type == "schema":  # an int from doc_to_text means "one context per choice" in lm-eval
        spec.update(
            output_type="multiple_choice",
            doc_to_text="gold",
            doc_to_target="continuation",
            doc_to_choice="context_options",
        )
    elif task.type == "language_modeling":
        assert task.num_fewshot == 0
        spec.update(
            output_type="loglikelihood",
            doc_to_text="context",
            doc_to_target="{{'" + task.target_delimiter + "' + continuation}}",
        )
    elif task.type == "perplexity":
        spec.update(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="text")
    else:
        spec.update(
            output_type="generate_until",
            doc_to_text="context",
            doc_to_target="answer",
            generation_kwargs={
                "until": task.stop_sequences,
                "max_gen_toks": task.max_new_tokens,
                "do_sample": False,
            },
        )
    return spec


def run_lm_eval(
    model, model_args: str | None, tasks: list[TaskConfig], tmp: Path, limit: int | None = None
) -> dict:
    from lm_eval.tasks import TaskManager

    task_dir = tmp / "lm_eval_tasks"
    task_dir.mkdir(exist_ok=True)
    for task in tasks:
        (task_dir / f"{task.name}.yaml").write_text(yaml.safe_dump(lm_eval_task(task, tmp / "hf_cache")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[t.name for t in tasks],
            batch_size=4,
            device="cpu",
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            log_samples=True,
            limit=limit,
            bootstrap_iters=0,
        )


def assert_same(ours: dict, theirs: dict, tasks: list[TaskConfig]) -> None:
    """Equal metrics, and per-example log-likelihoods / generations agreeing to float32 precision."""
    for task in tasks:
        res = theirs["results"][task.name]
        for metric in LM_EVAL_METRICS[task.type]:
            value = ours["results"][task.name]["metrics"][metric]
            if metric in ("acc", "acc_norm", "exact_match"):
                assert value == res[f"{metric},none"], (task.name, metric)
            else:
                assert value == pytest.approx(res[f"{metric},none"], rel=1e-5), (task.name, metric)
        for sample in theirs["samples"][task.name]:
            mine = ours["samples"][task.name][sample["doc_id"]]
            if task.type == "generation":
                assert mine["prediction"] == sample["resps"][0][0]
                continue
            if task.type == "perplexity":
                lls, ref = [mine["loglikelihood"]], [r[0] for r in sample["resps"]]
            else:
                lls, ref = mine["loglikelihoods"], [r[0][0] for r in sample["resps"]]
                assert mine["context"] == sample["arguments"][0][0]  # the exact prompt text
            assert lls == pytest.approx(ref, rel=1e-5, abs=1e-4)


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lm_eval_parity")


@pytest.fixture(scope="module")
def tokenizers(shipped_corpus, workdir):
    """A GPT-2 style BPE (nothing added by encode) and a Llama style one (encode prepends <s>)."""
    from tokenizers.processors import TemplateProcessing

    plain = train_bpe(shipped_corpus, 512, special_tokens=["<pad>", "<s>", "</s>"])
    with_bos = train_bpe(shipped_corpus, 512, special_tokens=["<pad>", "<s>", "</s>"])
    with_bos.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.token_to_id("<s>"))]
    )
    return {"gpt": plain, "llama": with_bos, "t5": plain}


def export(kind: str, tokenizer, directory: Path, max_seq_len: int = 64) -> Path:
    """Save a random model of ``kind`` in transformers format with its tokenizer (``save_hf`` declares the
    special tokens it holds: <pad>, <s>, </s>)."""
    torch.manual_seed(0)
    std = (
        {"init_std": 0.2} if kind != "t5" else {}
    )  # sharper random predictions: no near-ties between choices
    cfg = {**SCORING_ARCHS[kind], **std, "max_seq_len": max_seq_len}
    model = Transformer(ModelConfig(vocab_size=512, d_model=48, n_layer=2, n_head=4, **cfg))
    return save_hf(
        model, directory, tokenizer
    )  # the tokenizer files exactly as `pretrain export` writes them


@pytest.fixture(scope="module")
def synthetic_tasks(shipped_corpus, workdir) -> list[TaskConfig]:
    """Every task type on Shakespeare lines, with trailing spaces / newlines in some queries (as in PIQA)."""
    rng = random.Random(0)
    text = shipped_corpus.read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) >= 5][:400]
    mc = []
    for i in range(12):
        n = rng.choice([2, 3, 4])
        choices = [" ".join(rng.choice(lines).split()[: rng.randrange(1, 6)]) for _ in range(n)]
        query = f"Question: {lines[i]}" + ["\nAnswer:", "\n", " ", ""][i % 4]
        mc.append({"query": query, "choices": choices, "gold": rng.randrange(n)})
    schema = []
    for line in lines[20:30]:
        words = line.split()
        schema.append(
            {
                "context_options": [" ".join(words[:2]), " ".join(words[:3])],
                "continuation": " ".join(words[3:]),
                "gold": rng.randrange(2),
            }
        )
    lambada = [{"context": " ".join(ln.split()[:-1]), "continuation": ln.split()[-1]} for ln in lines[40:48]]
    docs = [{"text": "\n".join(lines[60 + 6 * i : 66 + 6 * i])} for i in range(3)]
    gen = [
        {"context": f"Q: {' '.join(ln.split()[:-1])}\nA:", "answer": ln.split()[-1]} for ln in lines[90:96]
    ]
    specs = [
        ("mc0", "multiple_choice", mc, 0),
        ("mc3", "multiple_choice", mc, 3),
        ("schema2", "schema", schema, 2),
        ("lambada0", "language_modeling", lambada, 0),
        ("rolling", "perplexity", docs, 0),
        ("gen1", "generation", gen, 1),
    ]
    tasks = []
    for name, kind, rows, shots in specs:
        path = workdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        extra = {"until": ["\n"], "max_new_tokens": 6, "strip": False} if kind == "generation" else {}
        tasks.append(TaskConfig(name=name, type=kind, path=str(path), num_fewshot=shots, **extra))
    return tasks


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("gpt", ["mc3", "schema2", "lambada0", "rolling", "gen1"]),
        ("llama", ["mc3", "rolling"]),
        ("t5", ["mc0", "schema2", "lambada0"]),
    ],
)
def test_same_numbers_as_lm_eval_hf(kind, names, tokenizers, synthetic_tasks, workdir):
    directory = export(kind, tokenizers[kind], workdir / kind)
    tasks = [t for t in synthetic_tasks if t.name in names]
    theirs = run_lm_eval("hf", f"pretrained={directory},dtype=float32,max_length=64", tasks, workdir)
    scorer = load_scorer(directory, batch_size=5, max_length=64)
    assert scorer.encode("to be") == tokenizers[kind].encode("to be").ids
    ours = evaluate(scorer, tasks, seed=1234, log_samples=True)
    assert_same(ours, theirs, tasks)


def test_adapter_runs_lm_eval_tasks_on_our_model(tokenizers, synthetic_tasks, workdir):
    from pretrain.evaluation.lm_eval_adapter import PretrainLM

    directory = export("gpt", tokenizers["gpt"], workdir / "gpt-adapter")
    scorer = load_scorer(directory, batch_size=3, max_length=64, padding_side="left")
    tasks = [t for t in synthetic_tasks if t.name in ("mc3", "rolling", "gen1")]
    through_adapter = run_lm_eval(PretrainLM(scorer=scorer), None, tasks, workdir)
    assert_same(evaluate(scorer, tasks, seed=1234, log_samples=True), through_adapter, tasks)
    by_name = run_lm_eval("pretrain", f"checkpoint={directory},max_length=64", tasks[:1], workdir)
    assert by_name["results"]["mc3"] == through_adapter["results"]["mc3"]


def test_rolling_windows_equal_lm_eval_utils():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from pretrain.evaluation.perplexity import disjoint_window, rolling_token_windows

    for n in (0, 1, 5, 16, 17, 40):
        for max_seq_len, context_len in ((1, 1), (4, 1), (8, 3), (16, 16)):
            tokens = list(range(n))
            ours = [disjoint_window(w) for w in rolling_token_windows(tokens, -1, max_seq_len, context_len)]
            theirs = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(tokens, -1, max_seq_len, context_len)
            ]
            assert ours == theirs


def test_shipped_tasks_match_lm_eval_on_the_real_data(shared_data, tokenizers, workdir):
    directory = export("gpt", tokenizers["gpt"], workdir / "gpt-real", max_seq_len=256)
    shots = {"copa": 3, "winogrande": 2, "piqa": 1, "lambada_openai": 0}
    tasks = [load_task(resolve_task_file(name), shared_data, {"num_fewshot": k}) for name, k in shots.items()]
    theirs = run_lm_eval("hf", f"pretrained={directory},dtype=float32", tasks, workdir, limit=12)
    ours = evaluate(load_scorer(directory, batch_size=8), tasks, seed=1234, limit=12, log_samples=True)
    assert_same(ours, theirs, tasks)
    assert {r["num_examples"] for r in ours["results"].values()} == {12}
