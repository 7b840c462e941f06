"""Checkpoint averaging (``pretrain.checkpoint.merge``): the merged weights equal a reference weighted
average in float32 bitwise (and float64's to 1e-6), from files and DCP directories alike (DeepSpeed directories:
``test_reshard.py``); different models, different tokenizers and weights that do not sum to 1 are refused in one
line. The merge holds one tensor of each input at a time: ``benchmarks/bench_convert.py`` measures it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from pretrain.checkpoint.convert import load_model
from pretrain.checkpoint.io import METADATA, PAYLOAD, read
from pretrain.checkpoint.merge import merge
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

CONFIG = ModelConfig(arch="decoder", vocab_size=300, d_model=16, n_layer=2, n_head=2, d_ff=32, max_seq_len=16)


def checkpoint(seed: int, config: ModelConfig = CONFIG, tokenizer: str | None = None) -> dict:
    torch.manual_seed(seed)
    model = Transformer(config)
    return {
        "global_step": seed,
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        PAYLOAD: {"config": {"model": dataclasses.asdict(config)}, "tokenizer_json": tokenizer},
    }


def as_file(tmp_path, name, ckpt):
    torch.save(ckpt, tmp_path / name)
    return tmp_path / name


def as_dcp(tmp_path, name, ckpt):
    """The layout of FSDP's sharded checkpoints (and of checkpoint.async_save): DCP shards + meta.pt."""
    tensors = {"state_dict": ckpt.pop("state_dict")}
    ckpt.pop("optimizer_states")
    torch_dcp.save(tensors, checkpoint_id=tmp_path / name, no_dist=True)
    torch.save(ckpt, tmp_path / name / METADATA)
    return tmp_path / name


def reference(states, weights, dtype=torch.float32):
    out = {}
    for key in states[0]:
        total = torch.zeros(states[0][key].shape, dtype=dtype)
        for state, weight in zip(states, weights, strict=True):
            total = total + weight * state[key].to(dtype)
        out[key] = total
    return out


def test_merge_of_files_and_dcp_directories_is_the_weighted_average(tmp_path):
    inputs = [checkpoint(1), checkpoint(2), checkpoint(3)]
    states = [dict(c["state_dict"]) for c in inputs]
    paths = [
        as_file(tmp_path, "a.ckpt", inputs[0]),
        as_dcp(tmp_path, "b", inputs[1]),
        as_file(tmp_path, "c.ckpt", inputs[2]),
    ]
    weights = [0.5, 0.3, 0.2]
    out = merge(paths, tmp_path / "merged.ckpt", weights)
    merged = read(out)
    expected, exact = reference(states, weights), reference(states, weights, torch.float64)
    assert merged["state_dict"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(merged["state_dict"][key], value), key
        torch.testing.assert_close(merged["state_dict"][key].double(), exact[key], rtol=0, atol=1e-6)
    assert merged[PAYLOAD]["merge_weights"] == weights and "optimizer_states" not in merged
    assert merged["global_step"] == 3  # the last input's state
    model, _, _ = load_model(out)  # what validate / export / evaluate read
    torch.testing.assert_close(
        model.state_dict()["embed.tok.weight"], expected["model.embed.tok.weight"], rtol=0, atol=0
    )
    uniform = read(merge(paths, tmp_path / "uniform.ckpt"))["state_dict"]
    assert torch.equal(
        uniform["model.embed.tok.weight"], reference(states, [1 / 3] * 3)["model.embed.tok.weight"]
    )


def test_weights_that_do_not_sum_to_one_are_refused(tmp_path):
    paths = [as_file(tmp_path, f"{i}.ckpt", checkpoint(i)) for i in range(2)]
    with pytest.raises(
        ValueError,
        match=r"--weights sum to 0.9, not 1; .* not rescaled: give weights that sum to 1 \(e.g. 0.555556,0.444444\)",
    ):
        merge(paths, tmp_path / "m.ckpt", [0.5, 0.4])
    # weights summing to 0 (extrapolation's 1,-1) or not finite: one line too, not a division by zero
    with pytest.raises(ValueError, match=r"--weights sum to 0, not 1; .* \(e.g. 0.5,0.5\)"):
        merge(paths, tmp_path / "m.ckpt", [1.0, -1.0])
    with pytest.raises(ValueError, match="--weights nan,1.0: every weight must be a finite number"):
        merge(paths, tmp_path / "m.ckpt", [float("nan"), 1.0])
    with pytest.raises(ValueError, match="--weights gives 3 weights for 2 checkpoints"):
        merge(paths, tmp_path / "m.ckpt", [0.5, 0.25, 0.25])
    assert not (tmp_path / "m.ckpt").exists()


def test_different_models_or_tokenizers_are_refused(tmp_path):
    a = as_file(tmp_path, "a.ckpt", checkpoint(1))
    wider = as_file(tmp_path, "b.ckpt", checkpoint(2, dataclasses.replace(CONFIG, d_model=32, d_ff=64)))
    with pytest.raises(
        ValueError, match=r"different models \(model.d_ff: 32 vs 64, model.d_model: 16 vs 32\)"
    ):
        merge([a, wider], tmp_path / "m.ckpt")
    other = as_file(tmp_path, "c.ckpt", checkpoint(3, tokenizer="another"))
    with pytest.raises(ValueError, match="trained with different tokenizers"):
        merge([a, other], tmp_path / "m.ckpt")
    # a finetune of a and a itself: was "trained with different tokenizers", though it was trained on a's (#32 sweep)
    finetuned = checkpoint(4, tokenizer="a's, with the finetune's template")
    finetuned[PAYLOAD]["finetune"] = {"head": {"kind": "classification"}}
    with pytest.raises(ValueError, match="a `pretrain fit` checkpoint and a `pretrain finetune` one"):
        merge([a, as_file(tmp_path, "d.ckpt", finetuned)], tmp_path / "m.ckpt")
    assert not (tmp_path / "m.ckpt").exists()


def test_pretrain_merge_writes_the_library_merge_and_refuses_bad_weights_in_one_line(tmp_path, capsys):
    from training_utils import one_error_line

    from pretrain.cli import main

    inputs = [checkpoint(1), checkpoint(2)]
    states = [dict(c["state_dict"]) for c in inputs]
    paths = [as_file(tmp_path, "a.ckpt", inputs[0]), as_dcp(tmp_path, "b", inputs[1])]
    out = tmp_path / "merged.ckpt"
    assert main(["merge", *map(str, paths), "--out", str(out), "--weights", "0.75,0.25"]) == 0
    merged = read(out)["state_dict"]
    for key, value in reference(states, [0.75, 0.25]).items():
        assert torch.equal(merged[key], value), key
    line = one_error_line(capsys, "merge", *paths, "--out", tmp_path / "m.ckpt", "--weights", "0.75;0.25")
    assert "give numbers separated by commas" in line
    line = one_error_line(capsys, "merge", *paths, "--out", tmp_path / "m.ckpt", "--weights", "0.5,0.4")
    assert "--weights sum to 0.9, not 1" in line
    assert not (tmp_path / "m.ckpt").exists()


def test_a_merge_overwrites_nothing_and_is_never_resumed(tmp_path):
    """`pretrain merge A B --out A` replaced the run's last.ckpt with weights only (its optimizer and data state
    lost), and resume=auto took a merged file of the highest step in a run's checkpoints: a KeyError from
    Lightning after the set-up. Now --out must be new, resume=auto skips a merged file with a warning, and
    resume=MERGED is refused in one line naming init.checkpoint."""
    from pretrain.checkpoint.resume import check_trainable, find_resume

    run = tmp_path / "checkpoints"
    run.mkdir()
    a, b = as_file(run, "a.ckpt", checkpoint(1)), as_file(tmp_path, "b.ckpt", checkpoint(2))
    before = a.read_bytes()
    with pytest.raises(
        ValueError, match=r"--out .*a.ckpt exists; merge into a new path \(nothing is overwritten\)"
    ):
        merge([a, b], a)
    assert a.read_bytes() == before
    merged = merge([a, b], run / "merged.ckpt")  # step 2 (b's), above a's step 1
    with pytest.warns(
        UserWarning, match=r"skipping .*merged.ckpt: weights only \(a `pretrain merge` output\)"
    ):
        assert find_resume(run) == a
    with pytest.raises(
        ValueError, match=r"holds weights only .*; start a run from its weights with init.checkpoint="
    ):
        check_trainable(merged)
    check_trainable(a)
