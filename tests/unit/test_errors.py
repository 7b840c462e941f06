"""One error path for every verb (``pretrain.errors``): known kinds of failure become one line with the fix and
exit status 2, wherever in the verb they arise; ``--debug`` gives the traceback; anything else stays a traceback."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from pretrain import errors
from pretrain.cli import main
from pretrain.compat.lightning import StepProgressBar


@pytest.fixture
def failing_validate(monkeypatch):
    """``pretrain validate`` whose work raises the exception given to the returned setter."""

    def fail_with(exc: BaseException) -> None:
        def handler(args):
            raise exc

        monkeypatch.setattr("pretrain.cli.validate.main", handler)

    return fail_with


@pytest.mark.parametrize(
    "exc, expected",
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "lower data.micro_batch_size",
        ),
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"), "out of memory"),
        (OSError(errno.ENOSPC, "No space left on device", "runs/x/last.ckpt"), "free space there"),
        (PermissionError(errno.EACCES, "Permission denied", "/ro/x"), "choose a path you may read and write"),
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:2"
            ),
            "another rank of this run died",
        ),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "runs/x"), "Is a directory"),
        (OSError(errno.EMFILE, "Too many open files"), "raise the open-file limit (ulimit -n)"),
        (OSError(errno.EROFS, "Read-only file system", "/ro/x"), "the file system is read-only"),
        (
            MisconfigurationException(
                "`Trainer(devices=3)` value is not a valid input using cpu accelerator."
            ),
            "Lightning's check of the trainer settings: see trainer.accelerator, trainer.devices",
        ),
    ],
)
def test_known_failures_are_one_line_with_the_fix(capsys, failing_validate, exc, expected):
    failing_validate(exc)
    assert main(["validate", "recipe.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain validate: error: ") and expected in err, err


def test_debug_shows_the_traceback_and_a_bug_keeps_it(failing_validate, monkeypatch):
    failing_validate(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        main(["validate", "recipe.yaml", "--debug"])
    monkeypatch.setenv("PRETRAIN_DEBUG", "1")
    with pytest.raises(torch.OutOfMemoryError):
        main(["validate", "recipe.yaml"])
    monkeypatch.delenv("PRETRAIN_DEBUG")
    for bug in (
        KeyError("a bug"),
        ValueError("a bug of ours, not bad input"),
    ):  # only InputError is bad input
        failing_validate(bug)
        with pytest.raises(type(bug)) as raised:
            main(["validate", "recipe.yaml"])
        assert "this is a bug in pretrain" in raised.value.__notes__[-1]


def test_a_dead_rank_is_named_with_how_to_resume():
    line = str(errors.RankDied([1], this_rank=0, cause=RuntimeError("Connection reset by peer")))
    assert line.startswith("rank 1 died") and "rerun the same command to resume" in line


def test_the_progress_bar_has_no_negative_epoch_count():
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(1).strip() == "Epoch 1"


def test_a_directory_given_as_a_checkpoint_names_the_file_to_pass(capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert main(["generate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path} is a directory, not a checkpoint: pass a checkpoint file (e.g. {tmp_path}/checkpoints/last.ckpt)"
        in err
    )


def test_our_warnings_are_one_line_and_a_resumes_directory_notice_is_dropped(monkeypatch):
    """A resume with resume_allow printed '/.../pretrain/training/setup.py:427: UserWarning: resuming ...' and then
    the source line 'changes = compare_for_resume(...)', and Lightning's 'Checkpoint directory ... exists and is not
    empty' on every resume. Our warnings are now 'warning: <message>' (libraries' keep Python's format), and the
    notice is dropped. Found by the #32 sweep."""
    import warnings

    import pretrain.training.setup
    from pretrain.training.quiet import quiet_libraries

    monkeypatch.delenv("PRETRAIN_DEBUG", raising=False)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = warnings.formatwarning
        quiet_libraries()
        ours = pretrain.training.setup.__file__
        assert warnings.formatwarning("resuming x", UserWarning, ours, 427, "src") == "warning: resuming x\n"
        library = ("a notice", UserWarning, "/lib/lightning/x.py", 3, "src")
        assert warnings.formatwarning(*library) == before(*library)
        warnings.warn_explicit(
            "Checkpoint directory /r/checkpoints exists and is not empty.",
            UserWarning,
            "model_checkpoint.py",
            881,
            module="lightning.pytorch.callbacks.model_checkpoint",
        )
    assert not caught


def test_a_format_that_wraps_ours_in_turn_does_not_recurse(monkeypatch):
    """quiet_libraries, then a library wrapping the format it finds (Lightning, imported after: its
    _custom_format_warning calls the format it replaced, ours), then quiet_libraries again (wrapping Lightning's):
    each called the other until RecursionError, a pytest INTERNALERROR (found by the #29 convert work)."""
    import warnings

    from pretrain.training.quiet import quiet_libraries

    monkeypatch.delenv("PRETRAIN_DEBUG", raising=False)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    quiet_libraries()
    wrapped = warnings.formatwarning

    def library_format(
        message, category, filename, lineno, line=None
    ):  # as Lightning's wraps the one it found
        return wrapped(message, category, filename, lineno, line)

    warnings.formatwarning = library_format
    quiet_libraries()
    assert warnings.formatwarning("a notice", UserWarning, "/lib/x.py", 3, "src") == (
        "/lib/x.py:3: UserWarning: a notice\n"
    )
