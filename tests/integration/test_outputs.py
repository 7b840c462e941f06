"""What a run leaves its user (issue 32): checkpoints and exports readable as the user's umask says (they were
0600: tempfile's, and transformers' temporary weights file), and no library notices on a verb that is not fit
(torchao's kernels that do not load here, torch's pytree deprecations, DeepSpeed settling on the CPU)."""

from __future__ import annotations

import os
import stat

from training_utils import run_cli, tiny_recipe

from pretrain.cli import main

NOTICES = ("Failed to load", "register_constant", "Setting accelerator to CPU")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_checkpoints_and_exports_follow_the_umask_and_export_prints_no_library_notices(tmp_path, tiny_world):
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", trainer={"max_steps": 2, "val_check_interval": 2})
    previous = os.umask(0o027)  # group may read, others nothing: neither 0600 nor the usual 0644
    try:
        assert main(["fit", str(recipe)]) == 0
        out = run_cli(
            "export", str(tmp_path / "run/checkpoints/last.ckpt"), str(tmp_path / "hf")
        )  # inherits it
    finally:
        os.umask(previous)
    assert not [n for n in NOTICES if n in out.stdout + out.stderr], out.stderr
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) == 2 and {p.name: mode(p) for p in checkpoints} == {
        p.name: 0o640 for p in checkpoints
    }
    exported = sorted((tmp_path / "hf").iterdir())
    assert "model.safetensors" in {p.name for p in exported} and mode(tmp_path / "hf") == 0o750
    assert {p.name: mode(p) for p in exported} == {p.name: 0o640 for p in exported}
