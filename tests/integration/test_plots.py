"""Offline run curves (``pretrain.training.callbacks.plots``): what is read from the CSV logs, and ``pretrain plot``."""

from __future__ import annotations

from pretrain.cli import main
from pretrain.training.callbacks.plots import read_curves

HEADER = "epoch,step,train/tokens_per_device,train/loss,train/lr,train/seconds,val/loss\n"


def write_log(run_dir, version: int, rows: list[str]) -> None:
    path = run_dir / "logs" / f"version_{version}" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + "".join(row + "\n" for row in rows))


def test_curves_from_the_csv_log_joined_over_resumed_versions(tmp_path):
    write_log(tmp_path, 0, ["0,0,100,,,1.0,", "0,0,,5.0,0.001,,", "0,1,300,,,2.0,", "0,1,,4.0,0.002,,4.5"])
    write_log(tmp_path, 1, ["0,2,100,,,10.0,", "0,2,,3.0,0.003,,", "0,3,500,,,12.0,"])
    curves = read_curves(tmp_path)
    assert curves["train/loss"] == [(0, 5.0), (1, 4.0), (2, 3.0)]
    assert curves["val/loss"] == [(1, 4.5)] and curves["train/lr"][-1] == (2, 0.003)
    # (300 - 100) tokens / (2 - 1) s; the resumed version restarts the counters: (500 - 100) / (12 - 10)
    assert curves["tokens/s"] == [(1, 200.0), (3, 200.0)]


def test_plot_command_overlays_runs_and_names_a_run_without_log(tmp_path, capsys):
    for name in ("a", "b"):
        write_log(
            tmp_path / name, 0, ["0,0,10,,,1.0,", "0,0,,5.0,0.1,,", "0,1,30,,,2.0,", "0,1,,4.0,0.1,,4.2"]
        )
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and "curves of 2 run(s)" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "has no CSV log" in capsys.readouterr().err


def test_a_later_version_supersedes_the_rows_of_a_branch_the_run_left(tmp_path):
    """`pretrain fit ... resume=null` in runs/w2 (an earlier run there had logged steps 1..6), then
    `pretrain plot runs/w2`: the curve was [(1, ..), .., (6, ..), (1, ..), (2, ..)], two runs joined as one (so was
    the ladder's last validation). A version starts where its launch did; the earlier rows from there on are of
    a branch the run left: a fresh run, a resume from an earlier checkpoint, steps logged after the last
    checkpoint of a killed run. Found by the #32 sweep."""
    from pretrain.ladder.run import final_validation

    write_log(
        tmp_path, 0, ["0,1,,6.0,0.001,,", "0,2,,5.0,0.001,,5.5", "0,3,,4.0,0.001,,", "0,4,,3.0,0.001,,3.5"]
    )
    write_log(tmp_path, 1, ["0,3,,4.1,0.001,,", "0,4,,3.1,0.001,,3.6"])  # resumed from step 2's checkpoint
    assert read_curves(tmp_path)["train/loss"] == [(1, 6.0), (2, 5.0), (3, 4.1), (4, 3.1)]
    assert final_validation(tmp_path) == (4, 3.6)
    write_log(tmp_path, 2, ["0,1,,7.0,0.001,,", "0,2,,6.5,0.001,,6.6"])  # a fresh run (resume=null)
    assert read_curves(tmp_path)["train/loss"] == [(1, 7.0), (2, 6.5)]
    assert final_validation(tmp_path) == (2, 6.6)
