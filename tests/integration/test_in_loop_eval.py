"""Evaluation during fit: the numbers logged at a step equal ``pretrain evaluate`` on the checkpoint of that step
(decoder, encoder by pseudo-log-likelihood, encoder-decoder; 1 and 2 ranks), the losses are bitwise those of
a run without it (dropout on), and a resumed run continues the evaluations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_utils import launch_metrics, metric_by_step, read_metrics, run_cli, run_ranks, tiny_recipe

from pretrain.training.plots import read_curves

WORKER = Path(__file__).with_name("fit_worker.py")


@pytest.fixture(scope="module")
def eval_tasks(tiny_world, tmp_path_factory) -> list[str]:
    """Task YAMLs on the tiny corpus: 12 two-way choices (the true next line or another one) and 3 documents."""
    tmp = tmp_path_factory.mktemp("in_loop_tasks")
    lines = [s for s in tiny_world["corpus"].read_text(encoding="utf-8").splitlines() if 10 < len(s) < 40]
    items = []
    for i in range(12):
        good, bad = lines[2 * i + 1].split()[0], lines[(7 * i + 40) % len(lines)].split()[0]
        items.append(
            {"query": lines[2 * i], "choices": [good, bad] if i % 2 else [bad, good], "gold": 1 - i % 2}
        )
    (tmp / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    (tmp / "ppl.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(lines[k : k + 12])}) + "\n" for k in (0, 50, 99))
    )
    files = []
    for name, kind in (("mc", "multiple_choice"), ("ppl", "perplexity")):
        path = tmp / f"{name}.yaml"
        path.write_text(f"name: {name}\ntype: {kind}\npath: {tmp / name}.jsonl\n")
        files.append(str(path))
    return files


def eval_section(tasks: list[str]) -> dict:
    return {"tasks": tasks, "every_n_steps": 5, "num_fewshot": 1, "batch_size": 3}


def logged_eval(run_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of the ``eval/`` columns of every launch's CSV."""
    out: dict[int, dict[str, float]] = {}
    for row in read_metrics(run_dir):
        for name, value in row.items():
            if name.startswith("eval/") and value not in (None, ""):
                out.setdefault(int(row["step"]), {})[name] = float(value)
    return out


def evaluate_checkpoint(checkpoint: Path, tasks: list[str], out: Path) -> dict[str, float]:
    run_cli(
        "evaluate", str(checkpoint), "--tasks", ",".join(tasks), "--num-fewshot", "1", "--output", str(out)
    )
    results = json.loads(out.read_text())
    flat = {f"eval/{t}/{m}": v for t, r in results["results"].items() for m, v in r["metrics"].items()}
    return flat | {"eval/core": results["core"]}


def assert_same_numbers(logged: dict[str, float], reference: dict[str, float]) -> None:
    for name, value in reference.items():
        assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


@pytest.mark.parametrize("kind", ["gpt", "bert", "t5"])
def test_in_loop_numbers_equal_pretrain_evaluate_on_the_checkpoint(kind, tiny_world, eval_tasks, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_world, kind, eval_during_fit=eval_section(eval_tasks))
    run_cli("fit", str(recipe))
    logged = logged_eval(tmp_path / "run")
    assert sorted(logged) == [5, 10]
    for step in (5, 10):
        seconds = {k for k in logged[step] if k.endswith("seconds")}
        assert seconds == {"eval/seconds", "eval/mc/seconds", "eval/ppl/seconds"}
    reference = evaluate_checkpoint(
        tmp_path / "run" / "checkpoints" / "last.ckpt", eval_tasks, tmp_path / "e.json"
    )
    assert_same_numbers(logged[10], reference)
    assert logged[5]["eval/mc/acc"] != logged[10]["eval/mc/acc"] or logged[5] != logged[10]  # it is re-scored
    if kind == "gpt":  # curves.png reads the same columns
        curves = read_curves(tmp_path / "run")
        assert [s for s, _ in curves["eval/core"]] == [5, 10] and "eval/mc/acc" in curves
        assert (tmp_path / "run" / "curves.png").is_file()


def test_in_loop_eval_leaves_the_losses_bitwise_and_survives_resume(tiny_world, eval_tasks, tmp_path):
    model = {"dropout": 0.1}  # dropout on: its masks must not move
    for name in ("plain", "evaluated"):
        (tmp_path / name).mkdir()
    plain = tiny_recipe(tmp_path / "plain", tiny_world, "gpt", model=model)
    evaluated = tiny_recipe(
        tmp_path / "evaluated", tiny_world, "gpt", model=model, eval_during_fit=eval_section(eval_tasks)
    )
    run_cli("fit", str(plain), "trainer.max_steps=15")
    run_cli("fit", str(evaluated), "trainer.max_steps=10")
    run_cli("fit", str(evaluated), "trainer.max_steps=15")  # resume=auto from step 10
    reference = metric_by_step(read_metrics(tmp_path / "plain" / "run"), "train/loss")
    launches = launch_metrics(tmp_path / "evaluated" / "run")
    assert len(launches) == 2
    losses = {s: v for rows in launches for s, v in metric_by_step(rows, "train/loss").items()}
    assert losses == reference and len(reference) == 15  # bitwise: the CSV holds every float exactly
    evaluated_steps = [sorted(logged_eval_rows(rows)) for rows in launches]
    assert evaluated_steps == [[5, 10], [15]]  # step 10 is not evaluated again after the resume


def logged_eval_rows(rows: list[dict[str, str]]) -> set[int]:
    return {int(r["step"]) for r in rows if r.get("eval/core") not in (None, "")}


def test_two_rank_fsdp2_in_loop_eval_equals_pretrain_evaluate(tiny_world, eval_tasks, tmp_path):
    """Examples sharded over 2 gloo ranks of an FSDP2 run, gathered: the same numbers as one process."""
    recipe = tiny_recipe(
        tmp_path,
        tiny_world,
        "gpt",
        eval_during_fit=eval_section(eval_tasks),
        trainer={"devices": 2, "accelerator": "cpu"},
        strategy={"name": "fsdp", "fsdp": {"state_dict_type": "full"}},
    )
    run_ranks(WORKER, "fit", str(recipe), log_dir=tmp_path)
    logged = logged_eval(tmp_path / "run")
    assert sorted(logged) == [5, 10]
    reference = evaluate_checkpoint(
        tmp_path / "run" / "checkpoints" / "last.ckpt", eval_tasks, tmp_path / "e.json"
    )
    assert_same_numbers(logged[10], reference)
