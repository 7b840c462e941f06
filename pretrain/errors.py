"""One error path for every verb: a known kind of failure becomes one line naming the problem and the fix, exit
status 2; ``--debug`` (or ``PRETRAIN_DEBUG=1``) shows the full traceback instead.

Known kinds: bad input (``ValueError``, a missing file), storage (a full disk, a path the user may not write),
out of memory, and a data-parallel peer process that died. Anything else is a bug and keeps its traceback.
Imports nothing heavy: ``torch`` is looked up only if the failing code already imported it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from pretrain.datamodules.storage import STORAGE_ERRNOS

# what to lower, per verb, when memory runs out
MEMORY_FIX = {
    "fit": "lower data.micro_batch_size (raise trainer.accumulate_grad_batches to keep the global batch) or "
    "data.seq_len, or set trainer.activation_checkpointing=true",
    "validate": "lower data.micro_batch_size or data.seq_len",
    "finetune": "lower data.batch_size (raise trainer.accumulate_grad_batches to keep the batch) or "
    "data.max_length",
    "evaluate": "lower --batch-size or use --dtype bfloat16",
    "generate": "lower --num-samples or --max-new-tokens",
    "baseline": "lower the recipe's batch size",
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


def peer_gone(err: BaseException) -> bool:
    """Whether ``err`` (or its cause) is a collective failing because a peer process is gone."""
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
    if isinstance(err, RankDied):
        return str(err)
    if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        where = f" ({err.filename})" if err.filename and str(err.filename) not in str(err) else ""
        fix = (
            "free space there or point the run at another disk"
            if err.errno
            in (
                errno.ENOSPC,
                errno.EDQUOT,
                errno.EFBIG,  # a file-size limit: what a full disk looks like to one process
            )
            else "choose a path you may write"
        )
        return f"{err}{where}; {fix}"
    if isinstance(err, (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return str(err)
    if out_of_memory(err):
        return f"out of memory ({first_line(err)[:160]}); {MEMORY_FIX.get(verb, 'use a smaller batch')}"
    if peer_gone(err):
        return str(RankDied([], this_rank(), err))
    return None


def this_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """``--debug`` anywhere in ``argv`` (removed) or ``PRETRAIN_DEBUG`` set to anything but 0/empty."""
    flag = "--debug" in argv
    env = os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0")
    return flag or env, [a for a in argv if a != "--debug"]


def run_verb(verb: str, handler: Callable[[Any], int], args: Any, debug: bool) -> int:
    """``handler(args)``; a known failure printed as ``pretrain VERB: error: ...`` with exit status 2."""
    try:
        return handler(args)
    except Exception as err:
        line = None if debug else describe(err, verb)
        if line is None:
            raise
        print(f"pretrain {verb}: error: {line}", file=sys.stderr)
        return 2
