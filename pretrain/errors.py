"""One error path for every verb: a known kind of failure becomes one line naming the problem and the fix, exit
status 2; ``--debug`` (or ``PRETRAIN_DEBUG=1``) shows the full traceback instead.

Known kinds: bad input (``InputError``, raised where a recipe key, a flag, an environment variable, a data file
or a checkpoint is checked; a missing file), what the operating system refuses (a full disk, a path the user may
not write, too many open files, ...), a check of Lightning's on the trainer settings, out of memory, and a
data-parallel peer process that died. Anything else -- a ``ValueError`` or ``KeyError`` of our own code
included -- is a bug: it keeps its traceback, followed by one line asking for a report.
Imports nothing heavy: ``torch`` and Lightning are looked up only if the failing code already imported them.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any


class InputError(ValueError):
    """Bad input the user can fix: a recipe key, a command-line flag, an environment variable, a data file or a
    checkpoint of the wrong kind. The message names the problem and the fix in the user's terms (recipe keys,
    flags, variables; never Python parameter names); ``pretrain VERB`` prints it as one line, exit status 2.
    A ``ValueError`` so that library callers catching ``ValueError`` keep working."""


# where a bug is reported (the one line after its traceback)
BUG_REPORT = (
    "this is a bug in pretrain, not a problem with your input: please report it with the command you ran and the "
    "traceback above to the pretrain maintainers (the issue tracker of the repository you installed it from)"
)

# what to lower, per verb, when memory runs out
MEMORY_FIX = {
    "fit": "lower data.micro_batch_size (raise trainer.accumulate_grad_batches to keep the global batch) or "
    "data.seq_len, or set trainer.activation_checkpointing=true",
    "validate": "lower data.micro_batch_size or data.seq_len",
    "finetune": "lower data.micro_batch_size (raise trainer.accumulate_grad_batches to keep the batch) or "
    "data.max_length",
    "evaluate": "lower --batch-size or use --dtype bfloat16",
    "generate": "lower --num-samples or --max-new-tokens",
    "baseline": "lower data.micro_batch_size (baselines.batch_size for GloVe) or data.seq_len",
}

# what a collective reports when the process on the other end is gone (gloo, NCCL, the TCP store)
PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "remote process exited",
    "socket timeout",
)


class RankDied(RuntimeError):
    """A data-parallel process of this run died; ``ranks`` are the dead ones when known."""

    def __init__(self, ranks: list[int], this_rank: int, cause: BaseException | None = None):
        self.ranks, self.this_rank = ranks, this_rank
        who = f"rank {', '.join(map(str, ranks))}" if ranks else "another rank of this run"
        super().__init__(
            f"{who} died (killed or crashed: see its log or the job's output; rank {this_rank} stopped "
            f"with it); rerun the same command to resume from the last checkpoint (resume=auto)"
            + (f" [{first_line(cause)}]" if cause is not None else "")
        )


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def peer_gone(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is a collective failing because a peer process is gone."""
    err: BaseException | None = error
    while err is not None:
        torch = sys.modules.get("torch")
        dist_error = getattr(getattr(torch, "distributed", None), "DistError", ()) if torch else ()
        text = str(err).lower()
        if (dist_error and isinstance(err, dist_error)) or (
            isinstance(err, RuntimeError) and any(s in text for s in PEER_GONE)
        ):
            return True
        err = err.__cause__ or err.__context__
    return False


def out_of_memory(err: BaseException) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, MemoryError) or (
        isinstance(err, RuntimeError) and ("not enough memory" in text or "out of memory" in text.lower())
    )


def describe(err: BaseException, verb: str) -> str | None:
    """The one line for ``err`` of a known kind, else None (a bug: the traceback is the report)."""
    if isinstance(err, (RankDied, InputError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return str(err)
    if isinstance(err, OSError) and err.errno is not None and err.errno not in PROGRAM_ERRNOS:
        return os_refused(err)
    if out_of_memory(err):
        return f"out of memory ({first_line(err)[:160]}); {MEMORY_FIX.get(verb, 'use a smaller batch')}"
    if peer_gone(err):
        return str(RankDied([], this_rank(), err))
    if lightning_misconfigured(err):
        return (
            f"{first_line(err)} (Lightning's check of the trainer settings: see trainer.accelerator, "
            f"trainer.devices, trainer.num_nodes, trainer.precision and strategy.name)"
        )
    return None


# what the operating system says to a program that misuses it (a bug of ours, not the user's environment)
PROGRAM_ERRNOS = {errno.EBADF, errno.EFAULT}
# errno -> the fix, for what the operating system refuses most often
OS_FIX = {
    errno.ENOSPC: "free space there or point the run at another disk",
    errno.EDQUOT: "free space there (the disk quota is used up) or point the run at another disk",
    errno.EFBIG: "free space there, raise the file-size limit (ulimit -f) or point the run at another disk",
    errno.EACCES: "choose a path you may read and write, or change its permissions",
    errno.EPERM: "choose a path you may read and write, or change its permissions",
    errno.EROFS: "the file system is read-only: choose a path on a writable one",
    errno.EMFILE: "raise the open-file limit (ulimit -n) or lower data.num_workers",
    errno.ENFILE: "the system's open-file table is full: close other programs or lower data.num_workers",
    errno.ENAMETOOLONG: "choose a shorter path or name",
    errno.ELOOP: "a symbolic link on the path points back to itself: fix the link",
    errno.EXDEV: "keep the run's directories on one file system",
    errno.ENOTEMPTY: "the directory is not empty: remove it or choose another",
    errno.EEXIST: "the path exists already: remove it or choose another",
    errno.EIO: "the disk reports an input/output error: check it, or point the run at another disk",
    errno.ENOMEM: "the system is out of memory: lower the batch size or stop other programs",
}


def os_refused(err: OSError) -> str:
    """One line for an error of the operating system: its message, the path, and the fix when known."""
    where = f" ({err.filename})" if err.filename and str(err.filename) not in str(err) else ""
    code = err.errno or 0  # describe() passes errors with an errno only
    fix = OS_FIX.get(code, f"the operating system refused ({errno.errorcode.get(code, code)})")
    return f"{err}{where}; {fix}"


def lightning_misconfigured(err: BaseException) -> bool:
    """Whether ``err`` is one of Lightning's own checks of its configuration (``MisconfigurationException``)."""
    for name in ("lightning.fabric.utilities.exceptions", "lightning_fabric.utilities.exceptions"):
        kind = getattr(sys.modules.get(name), "MisconfigurationException", None)
        if kind is not None and isinstance(err, kind):
            return True
    return False


def report_bug(err: BaseException, verb: str) -> None:
    """Ask for a bug report on the line after ``err``'s traceback (a note of the exception; Python < 3.11,
    which has no notes: a line on stderr before the traceback)."""
    line = f"pretrain {verb}: {BUG_REPORT}"
    if hasattr(err, "add_note"):
        if line not in getattr(err, "__notes__", ()):
            err.add_note(line)
    else:
        print(line, file=sys.stderr)


def this_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """``--debug`` anywhere in ``argv`` (removed) or ``PRETRAIN_DEBUG`` set to anything but 0/empty."""
    flag = "--debug" in argv
    env = os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0")
    return flag or env, [a for a in argv if a != "--debug"]


def run_verb(verb: str, handler: Callable[[Any], int], args: Any, debug: bool) -> int:
    """``handler(args)``; a known failure printed as ``pretrain VERB: error: ...`` with exit status 2, any other
    raised with its traceback and a line asking for a bug report."""
    try:
        return handler(args)
    except Exception as err:
        line = describe(err, verb)
        if line is None:
            report_bug(err, verb)
            raise
        if debug:
            raise
        print(f"pretrain {verb}: error: {line}", file=sys.stderr)
        return 2
