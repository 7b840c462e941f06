"""A ladder's cells (pretrain.ladder.plan): sizes, budgets, N and F counted by hand, the cells' recipes, and
the one-line refusals of a ladder that cannot be fitted."""

import json

import pytest

from pretrain import config
from pretrain.ladder import run as cells_run
from pretrain.ladder.plan import plan_ladder, read_plan, write_plan
from pretrain.ladder.report import finished

RECIPE = "recipes/ladder-tiny.yaml"


def hand_counts(d: int, layers: int, vocab: int = 366, T: int = 64) -> tuple[int, int]:
    """(N, F) of the tiny ladder's decoder (no biases, ReLU^2 MLP of 4d, untied head, LayerNorm weights only):
    N = L (12 d^2 + 2 d) + d (final norm); F = 6 (12 L d^2 + d V) + 12 L d T."""
    return layers * (12 * d * d + 2 * d) + d, 6 * (12 * layers * d * d + d * vocab) + 12 * layers * d * T


def test_cells_of_the_tiny_ladder(tmp_path):
    plan = plan_ladder(RECIPE, [], tmp_path)
    assert len(plan.cells) == 4 * 3 and plan.tokens_per_step == 16 * 64
    by_name = {c.name: c for c in plan.cells}
    cell = by_name["d64-l2-c6e11"]
    n, f = hand_counts(64, 2)
    assert (cell.params, cell.flops_per_token) == (n, f)
    assert cell.steps == round(6e11 / f / 1024) and cell.tokens == cell.steps * 1024
    assert cell.flops == pytest.approx(6e11, rel=0.01)
    assert cell.shape.n_head == 2 and cell.shape.d_ff == 256
    held = [c.name for c in plan.cells if c.held_out]
    assert held == ["d96-l2-c1.8e12"]  # the largest budget's largest size


def test_cell_recipes_are_ordinary_runs_of_their_shape_and_budget(tmp_path):
    plan = plan_ladder(RECIPE, [], tmp_path)
    write_plan(plan, RECIPE, [])
    cell = plan.cells[5]
    run, _ = config.load(cell.recipe)
    assert (run.model.d_model, run.model.n_layer, run.model.n_head) == (
        cell.shape.d_model, cell.shape.n_layer, cell.shape.n_head,
    )  # fmt: skip
    assert run.trainer.max_steps == cell.steps and run.trainer.val_check_interval == cell.steps
    assert run.trainer.limit_val_batches is None  # the whole validation split
    assert run.run_dir == cell.run_dir and run.resume == "auto" and run.ladder is None
    assert run.logger.wandb.group == f"ladder-{tmp_path.name}" and run.logger.wandb.name == cell.name
    assert run.checkpoint.every_n_steps * 4 >= cell.steps  # a killed cell resumes from one of 4 checkpoints
    assert read_plan(tmp_path).cells[5] == cell


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.micro_batch_size=64"],
            r"^the sizes do not span the budgets: 1 cell\(s\) get fewer than ladder.min_steps=50",
        ),
        (
            ["ladder.flops=[6e11]"],
            r"^3 cell\(s\) to fit 5 parameters \(E, A, alpha, B, beta\) besides the held-out one",
        ),
        (
            ["model.parametrization=standard"],
            r"^a ladder trains every width with one learning rate, which needs muP",
        ),
        (["ladder.tokens_per_param=[10, 20]"], r"^give the token budgets as exactly one of ladder.flops"),
        (["~ladder"], r"^the recipe has no `ladder:` section"),
        (
            ["ladder.sizes.0.d_model=48"],
            r"^ladder.sizes: d_model=48 is not a multiple of the head dimension 32",
        ),
        (["ladder.sizez=[]"], r"unknown config key 'sizez' at ladder.sizez; did you mean sizes"),
    ],
)
def test_a_ladder_that_cannot_be_fitted_is_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        plan_ladder(RECIPE, overrides, tmp_path)
    assert "\n" not in str(err.value)


def test_one_directory_one_objective(tmp_path):
    plan = plan_ladder(RECIPE, [], tmp_path)
    write_plan(plan, RECIPE, [])
    body = json.loads((tmp_path / "plan.json").read_text())
    (tmp_path / "plan.json").write_text(json.dumps({**body, "objective": "mlm"}))
    with pytest.raises(
        ValueError, match=r"holds a ladder of objective 'mlm'; this recipe's is 'clm': one fit per"
    ):
        write_plan(plan, RECIPE, [])


def test_the_fit_names_failed_and_unfinished_cells(tmp_path):
    plan = plan_ladder(RECIPE, [], tmp_path)
    write_plan(plan, RECIPE, [])
    with pytest.raises(ValueError, match=r"^12 cell\(s\) not finished: d32-l1-c2e11, "):
        finished(plan)
    for i, cell in enumerate(plan.cells):
        (tmp_path / "runs" / cell.name / cells_run.RESULT_FILE).write_text(
            json.dumps({"loss": 2.0 + i / 100})
        )
    bad = plan.cells[4]
    (tmp_path / "runs" / bad.name / cells_run.RESULT_FILE).unlink()
    failure = {"reason": "exit status 1", "log": "fit.log", "last_line": "boom"}
    (tmp_path / "runs" / bad.name / cells_run.FAILED_FILE).write_text(json.dumps(failure))
    with pytest.raises(
        ValueError, match=rf"^1 cell\(s\) failed: {bad.name} \({bad.name}: exit status 1, log fit.log\)"
    ):
        finished(plan)
    kept, excluded = finished(plan, allow_failed=True)
    assert excluded == [bad.name] and len(kept) == 11 and bad.name not in {c.name for c, _ in kept}
    mlm = tmp_path / "runs" / plan.cells[0].name / "recipe.yaml"
    mlm.write_text(mlm.read_text().replace("name: clm", "name: mlm"))
    with pytest.raises(
        ValueError, match=r"^the cells mix objectives \['clm', 'mlm'\]: fit one ladder per objective"
    ):
        finished(plan, allow_failed=True)


def test_a_recipe_without_a_ladder_is_refused_before_a_tokenizer_or_corpus_is_made(
    tmp_path, monkeypatch, capsys
):
    """`pretrain ladder gpt-tiny --out DIR` trained the tokenizer and prepared the corpus before saying the recipe
    has no `ladder:` section; `pretrain ladder MISSING --budget F` asked for --out instead of naming the missing
    ladder directory."""
    from training_utils import one_error_line

    monkeypatch.chdir(tmp_path)
    line = one_error_line(capsys, "ladder", "gpt-tiny", "--out", tmp_path / "ladder")
    assert "the recipe has no `ladder:` section" in line
    assert not (tmp_path / "runs").exists()  # no tokenizer, no prepared corpus
    line = one_error_line(capsys, "ladder", tmp_path / "nope", "--budget", "1e13")
    assert f"--budget reads a finished ladder directory; {tmp_path / 'nope'} is not one" in line
