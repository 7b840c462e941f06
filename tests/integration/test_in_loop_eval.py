"""Evaluation during fit: the numbers logged at a step equal ``pretrain evaluate`` on the checkpoint of that step
(decoder, encoder by pseudo-log-likelihood, encoder-decoder; 1 and 2 ranks), the losses are bitwise those of
a run without it (dropout on), and a resumed run continues the evaluations."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from training_utils import (
    launch_metrics,
    metric_by_step,
    read_metrics,
    run_ranks,
    tiny_recipe,
    wandb_records,
)

from pretrain.cli import main as cli_main
from pretrain.training.callbacks.plots import read_curves

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


def eval_recipe(directory: Path, world: dict, kind: str, evaluated: bool = True, **sections) -> Path:
    """A tiny recipe of 4 steps (learning rate decaying over 6: a resumed run continues the same schedule),
    checkpointed and, when ``evaluated``, scored every 2 steps."""
    directory.mkdir(exist_ok=True)
    if evaluated:
        sections["eval_during_fit"] = {
            "tasks": world["eval_tasks"],
            "every_n_steps": 2,
            "num_fewshot": 1,
            "batch_size": 3,
        }
    trainer = {"max_steps": 4, "val_check_interval": 2, **sections.pop("trainer", {})}
    return tiny_recipe(
        directory,
        world,
        kind,
        trainer=trainer,
        optim={"warmup_steps": 2, "decay_steps": 6},
        checkpoint={"every_n_steps": 2, "save_top_k": 0},
        **sections,
    )


def logged_eval(rows: list[dict[str, str]]) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of the ``eval/`` columns of CSV rows."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        for name, value in row.items():
            if name.startswith("eval/") and value not in (None, ""):
                out.setdefault(int(row["step"]), {})[name] = float(value)
    return out


def evaluate_checkpoint(checkpoint: Path, tasks: list[str], out: Path) -> dict[str, float]:
    assert (
        cli_main(
            [
                "evaluate",
                str(checkpoint),
                "--tasks",
                ",".join(tasks),
                "--num-fewshot",
                "1",
                "--output",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    flat = {f"eval/{t}/{m}": v for t, r in results["results"].items() for m, v in r["metrics"].items()}
    return flat | {"eval/core": results["core"]}


def assert_same_numbers(logged: dict[str, float], reference: dict[str, float]) -> None:
    assert reference
    for name, value in reference.items():
        assert logged[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


@pytest.fixture(scope="module")
def world(tiny_world, eval_tasks) -> dict:
    return {**tiny_world, "eval_tasks": eval_tasks}


def test_decoder_in_loop_eval_is_pretrain_evaluate_leaves_losses_bitwise_and_survives_resume(world, tmp_path):
    model = {"dropout": 0.1}  # dropout on: its masks must not move
    plain = eval_recipe(tmp_path / "plain", world, "gpt", evaluated=False, model=model)
    evaluated = eval_recipe(tmp_path / "evaluated", world, "gpt", model=model)
    assert cli_main(["fit", str(plain), "trainer.max_steps=6"]) == 0
    assert cli_main(["fit", str(evaluated)]) == 0
    # resume=auto from step 4, curves.png drawn at its end
    assert cli_main(["fit", str(evaluated), "trainer.max_steps=6", "logger.curves=true"]) == 0
    run_dir = tmp_path / "evaluated" / "run"
    reference = metric_by_step(read_metrics(tmp_path / "plain" / "run"), "train/loss")
    launches = launch_metrics(run_dir)
    losses = {s: v for rows in launches for s, v in metric_by_step(rows, "train/loss").items()}
    assert losses == reference and len(reference) == 6  # bitwise: the CSV holds every float exactly
    assert [sorted(logged_eval(rows)) for rows in launches] == [[2, 4], [6]]  # step 4 not evaluated twice
    logged = logged_eval(read_metrics(run_dir))
    for step in (2, 4, 6):
        assert {k for k in logged[step] if k.endswith("seconds")} == {
            "eval/seconds",
            "eval/mc/seconds",
            "eval/ppl/seconds",
        }
    reference = evaluate_checkpoint(
        run_dir / "checkpoints" / "last.ckpt", world["eval_tasks"], tmp_path / "e.json"
    )
    assert_same_numbers(logged[6], reference)
    assert (
        logged[2]["eval/ppl/token_perplexity"] != logged[6]["eval/ppl/token_perplexity"]
    )  # re-scored as it learns
    curves = read_curves(run_dir)  # curves.png reads the same columns
    assert [s for s, _ in curves["eval/core"]] == [2, 4, 6] and "eval/mc/acc" in curves
    assert (run_dir / "curves.png").is_file()
    assert not (tmp_path / "plain" / "run" / "curves.png").exists()  # logger.curves=false (tiny_recipe's)


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_encoder_and_encoder_decoder_in_loop_eval_is_pretrain_evaluate(kind, world, tmp_path, caplog):
    """BERT by pseudo-log-likelihood, T5 as a seq2seq scorer: the numbers of the checkpoint at that step; the
    BERT run also logs them to (offline) W&B; the T5 one evaluates on steps ``trainer.sync_check=error`` checks
    (scoring reads back by design: before, its reads stopped the run)."""
    wandb = {"logger": {"wandb": {"enabled": True}, "csv": True}} if kind == "bert" else {}
    checked = {"trainer": {"sync_check": "error", "log_every_n_steps": 3}} if kind == "t5" else {}
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    assert cli_main(["fit", str(eval_recipe(tmp_path, world, kind, **wandb, **checked))]) == 0
    if checked:  # steps 2 and 4 evaluate and do not log (step 3 does)
        summary = "sync_check=error: 3 steps that do not log checked (rank 0); host reads: none"
        assert summary in caplog.text
    logged = logged_eval(read_metrics(tmp_path / "run"))
    assert sorted(logged) == [2, 4]
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert_same_numbers(logged[4], evaluate_checkpoint(checkpoint, world["eval_tasks"], tmp_path / "e.json"))
    if wandb:
        (run_file,) = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
        history = [
            {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(run_file)
            if r.WhichOneof("record_type") == "history"
        ]
        in_wandb = {h["trainer/global_step"]: h for h in history if "eval/core" in h}
        assert sorted(in_wandb) == [2, 4]
        assert {k: in_wandb[4][k] for k in logged[4]} == logged[4]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "zero3"])
def test_two_rank_in_loop_eval_equals_pretrain_evaluate(two_rank_runs, world, strategy):
    """Requests sharded over 2 gloo ranks of a BERT run (FSDP2, DDP, DeepSpeed ZeRO-3) and gathered: the numbers
    of one process on the checkpoint of that step. The ranks' pseudo-log-likelihoods need different numbers of
    forwards (masked rows), so under FSDP2 and ZeRO-3 the idle forwards that keep the parameter all-gathers
    paired must run, or the run hangs."""
    run_dir = two_rank_runs / strategy / "run"
    logged = logged_eval(read_metrics(run_dir))
    assert sorted(logged) == [2]
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    reference = evaluate_checkpoint(checkpoint, world["eval_tasks"], run_dir / "e.json")
    assert_same_numbers(logged[2], reference)


@pytest.fixture(scope="module")
def two_rank_runs(world, tmp_path_factory):
    """One launch of 2 ranks fitting 2 steps of BERT under each strategy, evaluated at step 2."""
    root = tmp_path_factory.mktemp("in_loop_2_ranks")
    strategies = {
        "fsdp": {"name": "fsdp", "fsdp": {"state_dict_type": "full"}},
        "ddp": {"name": "ddp", "ddp": {"process_group_backend": "gloo"}},
        "zero3": {"name": "deepspeed", "deepspeed": {"stage": 3, "param_persistence_threshold": 0}},
    }
    commands: list[str] = []
    for name, strategy in strategies.items():
        trainer = {"devices": 2, "accelerator": "cpu", "max_steps": 2}
        recipe = eval_recipe(root / name, world, "bert", trainer=trainer, strategy=strategy)
        commands += [*(["+"] if commands else []), "fit", str(recipe)]
    run_ranks(WORKER, *commands, log_dir=root, timeout=600)
    return root
