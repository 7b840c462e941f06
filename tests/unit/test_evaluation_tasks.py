"""Task files, example validation (file:line errors) and k-shot prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrain.evaluation.config import TASK_DIR, load_config, load_tasks
from pretrain.evaluation.prompts import FewShotSampler, build_requests
from pretrain.evaluation.tasks import TaskConfig, load_examples, load_task, task_from_dict

MC = [
    {
        "query": "The man turned on the faucet, therefore",
        "choices": ["the toilet filled.", "water flowed."],
        "gold": 1,
    },
    {
        "query": "The girl found a bug, therefore",
        "choices": ["she ate.", "she lost her appetite."],
        "gold": 1,
    },
    {
        "query": "The woman retired, therefore",
        "choices": ["she got her pension.", "she paid rent."],
        "gold": 0,
    },
    {
        "query": "I wanted to save energy, therefore",
        "choices": ["I swept.", "I shut off the light."],
        "gold": 1,
    },
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


# ---------------------------------------------------------------------------------------------- task files


def test_task_file_interpolates_data_root(tmp_path):
    task_file = tmp_path / "t.yaml"
    task_file.write_text("name: t\ntype: multiple_choice\npath: ${data_root}/icl/x.jsonl\nnum_fewshot: 2\n")
    task = load_task(task_file, data_root="/data", overrides={"num_fewshot": 5})
    assert task.path == "/data/icl/x.jsonl" and task.num_fewshot == 5
    assert (task.target_delimiter, task.fewshot_delimiter) == (" ", "\n\n")
    with pytest.raises(ValueError, match=r"t\.yaml.*data_root"):
        load_task(task_file)
    from pretrain.evaluation.config import EvalConfig, load_tasks  # the verb's own setting is named

    with pytest.raises(ValueError, match=r"t\.yaml.*data_root.*set --data-root"):
        load_tasks(EvalConfig(tasks=[str(task_file)], data_root=None))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"name": "t", "type": "multiple_choice"}, r"missing required task key\(s\) \['path'\]"),
        ({"name": "t", "type": "mc", "path": "x"}, r"type='mc' is not one of"),
        ({"name": "t", "type": "schema", "path": "x", "shots": 3}, r"unknown task key\(s\) \['shots'\]"),
        ({"name": "t", "type": "schema", "path": "x", "num_fewshot": -1}, "num_fewshot must be"),
        ({"name": "t", "type": "perplexity", "path": "x", "num_fewshot": 1}, "take no shots"),
    ],
)
def test_bad_task_definitions_name_the_problem(raw, match):
    with pytest.raises(ValueError, match=match):
        task_from_dict(raw, source="tasks/t.yaml")


@pytest.mark.parametrize(
    ("task_type", "bad_line", "match"),
    [
        ("multiple_choice", {"query": "q", "gold": 0}, r"missing key 'choices'"),
        (
            "multiple_choice",
            {"query": "q", "choices": ["a", "b"], "gold": 2},
            r"gold=2 is out of range for 2 choices",
        ),
        ("multiple_choice", {"query": "q", "choices": ["a", "b"], "gold": -1}, r"gold=-1 is out of range"),
        ("multiple_choice", {"query": "q", "choices": ["a", "b"], "gold": "1"}, r"'gold' must be a integer"),
        ("multiple_choice", {"query": "q", "choices": [], "gold": 0}, r"'choices' must be a non-empty list"),
        (
            "schema",
            {"context_options": ["a", "b"], "continuation": "c", "gold": 3},
            r"gold=3 is out of range",
        ),
        ("schema", {"context_options": ["a"], "gold": 0}, r"missing key 'continuation'"),
        ("language_modeling", {"context": "a"}, r"missing key 'continuation'"),
        ("generation", {"context": "a", "answer": 3}, r"'answer' must be a string or list"),
        ("multiple_choice", '{"query": "q", "choices": ["a"], ', r"invalid JSON"),
        ("multiple_choice", "[1, 2]", r"expected a JSON object"),
    ],
)
def test_bad_example_names_file_and_line(tmp_path, task_type, bad_line, match):
    good = {
        "multiple_choice": MC[0],
        "schema": {"context_options": ["a", "b"], "continuation": "c", "gold": 0},
        "language_modeling": {"context": "a", "continuation": "b"},
        "generation": {"context": "a", "answer": "b"},
    }[task_type]
    path = write_jsonl(tmp_path / "data.jsonl", [good, "", good, bad_line])  # blank line 2 is skipped
    with pytest.raises(ValueError, match=rf"data\.jsonl:4: {match}"):
        load_examples(path, task_type)


def test_missing_data_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(tmp_path / "nope.jsonl", "schema")


def test_shipped_task_files_validate_against_the_real_data(shared_data):
    names = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
    expected = {
        "arc_easy",
        "arc_challenge",
        "boolq",
        "copa",
        "openbook_qa",
        "piqa",
        "siqa",
        "winogrande",
        "winograd_wsc",
        "lambada_openai",
        "wikitext2",
    }
    assert expected <= set(names)
    config = load_config(
        "checkpoint-not-loaded", [f"data_root={shared_data}", f"tasks=[{','.join(names)}]"], {}
    )
    tasks = load_tasks(config)  # validates every example of every file
    assert {t.name for t in tasks} == set(names)
    assert all("${" not in t.path and t.path.startswith(str(shared_data)) for t in tasks)


def test_cli_config_layers_and_errors(tmp_path):
    recipe = tmp_path / "eval.yaml"
    recipe.write_text("checkpoint: null\ntasks: [copa]\nnum_fewshot: 3\nseed: 7\n")
    cfg = load_config(str(recipe), ["checkpoint=ckpt", "limit=10"], {"num_fewshot": 1, "seed": None})
    assert (cfg.checkpoint, cfg.tasks, cfg.num_fewshot, cfg.seed, cfg.limit) == ("ckpt", ["copa"], 1, 7, 10)
    with pytest.raises(ValueError, match="no checkpoint"):
        load_config(str(recipe), [], {})
    with pytest.raises(ValueError, match="no tasks"):
        load_config("ckpt", [], {})
    with pytest.raises(ValueError, match="unknown config key 'shots'"):
        load_config("ckpt", ["shots=3"], {"tasks": ["copa"]})
    with pytest.raises(FileNotFoundError, match="unknown task 'nope'.*copa"):
        load_tasks(load_config("ckpt", [], {"tasks": ["nope"]}))


# ---------------------------------------------------------------------------------------------- prompts


def test_kshot_prompt_is_exactly_the_documented_format():
    task = TaskConfig(name="copa", type="multiple_choice", path="x", num_fewshot=2)
    req = build_requests(task, MC, seed=1234)[0]
    shots = FewShotSampler(MC, 1234).sample(2, exclude=MC[0])
    expected = "".join(f"{s['query']} {s['choices'][s['gold']]}\n\n" for s in shots) + MC[0]["query"]
    assert [ctx for ctx, _ in req.pairs] == [expected, expected]
    assert [cont for _, cont in req.pairs] == [" the toilet filled.", " water flowed."]

    custom = TaskConfig(
        name="c",
        type="multiple_choice",
        path="x",
        num_fewshot=1,
        target_delimiter=": ",
        fewshot_delimiter="\n###\n",
        description="Answer.\n",
    )
    req = build_requests(custom, MC, seed=0)[2]
    (shot,) = FewShotSampler(MC, 0).sample(1, exclude=MC[2])
    prefix = f"Answer.\n{shot['query']}: {shot['choices'][shot['gold']]}\n###\n"
    assert req.pairs[0] == (prefix + MC[2]["query"], ": she got her pension.")


def test_schema_and_lambada_prompts():
    rows = [
        {"context_options": [f"A{i} said", f"B{i} said"], "continuation": f"word{i}.", "gold": i % 2}
        for i in range(3)
    ]
    schema = TaskConfig(name="w", type="schema", path="x", num_fewshot=1)
    req = build_requests(schema, rows, seed=3)[0]
    (shot,) = FewShotSampler(rows, 3).sample(1, exclude=rows[0])
    prefix = f"{shot['context_options'][shot['gold']]} {shot['continuation']}\n\n"
    assert req.pairs == [(prefix + "A0 said", " word0."), (prefix + "B0 said", " word0.")]
    lm = TaskConfig(name="l", type="language_modeling", path="x")
    assert build_requests(lm, [{"context": "He said", "continuation": "hi"}])[0].pairs == [("He said", " hi")]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 30), k=st.integers(0, 8), seed=st.integers(0, 2**31), dup=st.booleans())
def test_sampler_never_returns_the_evaluated_example(n, k, seed, dup):
    pool = [
        {"id": i % (n - 1) if dup else i} for i in range(n)
    ]  # dup: the pool holds two copies of one example
    sampler, drawn = FewShotSampler(pool, seed), []
    for example in pool:
        available = sum(p != example for p in pool)
        if k + 1 > n or k > available:
            with pytest.raises(ValueError, match="lower num_fewshot"):
                sampler.sample(k, exclude=example)
            return
        shots = sampler.sample(k, exclude=example)
        assert len(shots) == k and example not in shots
        drawn.append(shots)
    replay = FewShotSampler(pool, seed)
    assert [replay.sample(k, exclude=e) for e in pool] == drawn


def test_sampler_is_seeded_and_matches_lm_eval():
    from lm_eval.api import samplers

    pool = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(40)]
    for seed in (0, 1234):
        ours = FewShotSampler(pool, seed)
        theirs = samplers.ContextSampler(list(pool), rnd=seed)
        for example in pool:
            assert ours.sample(5, exclude=example) == list(theirs.sample(5, eval_doc=example))
        separate = FewShotSampler(pool, seed)
        reference = random.Random(seed)
        assert separate.sample(3) == reference.sample(pool, 3)  # a separate pool: plain sample, no exclusion
    a, b = FewShotSampler(pool, 1), FewShotSampler(pool, 2)
    assert [a.sample(3, exclude=e) for e in pool] != [b.sample(3, exclude=e) for e in pool]
