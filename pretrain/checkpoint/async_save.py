"""Checkpoints written off the training thread (``checkpoint.async_save``).

The training thread only starts a save and returns to training: a staging thread copies the state into host
buffers that are kept from one save to the next (``torch.distributed.checkpoint``'s ``DefaultStager``) while
the next step's forward and backward pass run, and that step's update waits for the copy (``wait_before_update``:
after the optimizer's closure, in which Lightning runs the forward and backward pass; until then nothing the
checkpoint holds changes). The state is copied once per save: where a host copy of this very state is being made
anyway (``host_copies``: the guards' snapshot taken at every checkpoint), its copies are written and only the
tensors it lacks are staged. A writer thread of the lowest CPU priority then, from that update on (the save
step's forward and backward pass keep the cores), writes the copy as a
torch.distributed.checkpoint directory (every rank its shards, a replicated tensor once) with DCP's ``save``, on a
gloo process group of its own (the training collectives keep theirs), through ``direct_write``: DCP's bytes,
around the page cache and paced to ``checkpoint.async_write_share`` of the wall clock. Once every rank's files and
DCP's ``.metadata`` are written (DCP's save gathers the ranks' write results on rank 0 before it writes
``.metadata``), rank 0 adds ``meta.pt`` (the Lightning state without weights) and puts the directory in place of
the checkpoint with one atomic exchange of names, in the writer thread as soon as the write is complete: a reader,
and a run killed at any moment, sees the previous checkpoint or the complete new one. At most one save is in
flight: a new one first waits for the previous one; ``wait`` finishes a pending save (end of fit, stop signal).

The layout is the one FSDP's sharded checkpoints have (``state_dict.*``, ``optimizer_<i>.*`` keyed by
parameter name, ``meta.pt``), under DDP and one process as well: every strategy reads it (``reshard``).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pretrain.checkpoint import dcp  # also installs its warning filter for no_dist saves
from pretrain.checkpoint.direct_write import direct_writer
from pretrain.checkpoint.io import METADATA, CheckpointWriteError
from pretrain.checkpoint.lightning_io import AtomicCheckpointIO
from pretrain.checkpoint.optimizer_state import dcp_state
from pretrain.compat.dtensor import local_shard
from pretrain.io import STORAGE_ERRNOS, replace_path
from pretrain.optim import wait_before_update

TMP_SUFFIX = ".tmp"  # ``.<name>.<random>.tmp``: what ``remove_partial_saves`` deletes after a kill


def staging_path(path: Path, token: str) -> Path:
    """The temporary sibling a checkpoint is written into before it replaces ``path``."""
    return path.with_name(f".{path.name}.{token}{TMP_SUFFIX}")


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor cloned (the metadata's few small tensors: the training goes on mutating them)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


TensorKey = tuple[Any, ...]
# ``host_copies(release)``: a function giving host copies of the state being saved (``tensor_key`` of a live tensor
# -> its copy; blocking until they are made), whose memory stays untouched until ``release`` is done; or None
HostCopies = Callable[[Future], Callable[[], dict[TensorKey, Tensor]] | None]


def tensor_key(tensor: Tensor) -> TensorKey:
    """What identifies a tensor's data in place (its local shard's, for a DTensor): two tensor objects with the same
    key view the same memory the same way (a parameter and its ``state_dict`` entry, say)."""
    local = local_shard(tensor)
    return (
        type(tensor),
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
        tuple(tensor.shape),
    )


def lower_thread_priority() -> None:
    """Run the calling thread at the lowest CPU priority (nice 19; Linux schedules each thread by its own nice
    value): the background write takes only CPU time the training threads leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux or not allowed: the write just competes as before
        pass


def storage_error(err: BaseException) -> BaseException:
    """The ``OSError`` a rank's write failed with, where DCP's save wrapped it in a ``CheckpointException``; else
    ``err``."""
    return next((e for e in dcp.rank_errors(err) if isinstance(e, OSError)), err)


class AsyncCheckpointWriter:
    """Writes DCP checkpoint directories in the background, one at a time (see the module docstring).

    A save costs the training thread a few dictionary look-ups: the copy into the host buffers runs in a
    staging thread while the next step's forward and backward pass run (they only read the state), and the
    next update waits for it (``wait_before_update`` on ``optimizers``: nothing the checkpoint holds changes before
    then). The write then runs in a thread of the lowest priority, the step's threads first, paced to ``share``
    of the wall clock (``direct_write``). ``host_copies`` (set
    by ``build_trainer``: the guards' snapshot) gives copies of the state made anyway, written instead of a second
    copy."""

    def __init__(self, share: float = 1.0) -> None:
        self.share = share  # of the wall clock the write keeps the storage busy (``direct_write``)
        self.host_copies: HostCopies | None = None
        self._stager: Any = None
        self._group: Any = None
        self._pending: Future | None = None
        self._staged: Future | None = None
        # set once the save step's update may go on: the write starts
        self._release: threading.Event | None = None
        self._hooked: set[int] = set()
        self._staging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pretrain-checkpoint-stage")
        self._writing = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pretrain-checkpoint", initializer=lower_thread_priority
        )

    @property
    def pending(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def save(
        self,
        tensors: dict[str, Any],
        meta: dict[str, Any],
        path: str | Path,
        *,
        distributed: bool,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Start writing ``tensors`` (a DCP state dict) and ``meta`` (``meta.pt``) as checkpoint ``path``.
        ``distributed``: every rank calls this at the same point and writes its shards (rank 0 puts the
        directory in place); else this process writes it all. Returns at once: the next ``step`` of
        ``optimizers`` (or ``wait_staged``) waits until ``tensors`` are copied to host buffers; without
        ``optimizers``, they are copied before this returns."""
        import torch.distributed as dist

        self.wait()
        token = [secrets.token_hex(4)]
        rank0 = True
        if distributed:
            if self._group is None:  # collective: every rank saves at the same step
                self._group = dist.new_group(backend="gloo")
            dist.broadcast_object_list(token, src=0, group=self._group)
            rank0 = dist.get_rank() == 0
        path = Path(path)
        tmp = staging_path(path, token[0])
        for optimizer in optimizers:
            if id(optimizer) not in self._hooked:
                self._hooked.add(id(optimizer))
                wait_before_update(optimizer, self.wait_staged)
        written: Future = Future()  # done once the write no longer reads the staged tensors
        copies = self.host_copies(written) if self.host_copies is not None else None
        self._staged = self._staging.submit(self._stage, tensors, copies)
        self._release = threading.Event()
        self._pending = self._writing.submit(
            self._write,
            self._staged,
            self._release,
            self.share,
            self._group,
            distributed,
            host_copy(meta) if rank0 else None,
            tmp,
            path,
            written,
        )
        if not optimizers:
            self.wait_staged()

    def _stage(self, tensors: dict[str, Any], copies: Callable[[], dict[TensorKey, Tensor]] | None) -> Any:
        """Staging thread: ``tensors`` with every tensor replaced by a host copy -- ``copies``' where it has one
        (of the same kind: a DTensor's copy is a DTensor), the others copied into the stager's buffers (kept from
        one save to the next)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        made = copies() if copies is not None else {}
        rest: list[Tensor] = []

        def substitute(obj: Any) -> Any:
            if isinstance(obj, Tensor):
                copy = made.get(tensor_key(obj))
                if copy is not None and type(copy) is type(obj):
                    return copy
                rest.append(obj)
                return _Rest(len(rest) - 1)
            if isinstance(obj, dict):
                return {k: substitute(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(substitute(v) for v in obj)
            return obj

        staged = substitute(tensors)
        if not rest:
            return staged
        if self._stager is None:  # host buffers reused by every save (no pinned or shared memory on the CPU)
            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        filled = self._stager.stage(rest)

        def fill(obj: Any) -> Any:
            if isinstance(obj, _Rest):
                return filled[obj.index]
            if isinstance(obj, dict):
                return {k: fill(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(fill(v) for v in obj)
            return obj

        return fill(staged)

    def wait_staged(self) -> None:
        """Block until the state of the last save is copied to host buffers (its errors come from ``wait``); the
        write starts then (at the save step's update: it does not compete with that step's forward and backward
        pass)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            futures.wait([staged])
        release, self._release = self._release, None
        if release is not None:
            release.set()

    @classmethod
    def _write(
        cls,
        staged: Future,
        release: threading.Event,
        share: float,
        group: Any,
        distributed: bool,
        meta: dict[str, Any] | None,
        tmp: Path,
        path: Path,
        written: Future,
    ) -> None:
        """Background, once the copy is staged and ``release`` set: every rank writes its files (DCP's save
        gathers the ranks' write results before rank 0 writes ``.metadata``), then rank 0 (which holds ``meta``)
        puts the directory in place. ``written`` is set once the staged tensors are no longer read."""
        from torch.distributed.checkpoint import save

        upload: Future = Future()
        try:
            state = staged.result()
            release.wait()
            save(
                state,
                storage_writer=direct_writer(tmp, share),
                process_group=group,
                no_dist=not distributed,
            )
            upload.set_result(None)
        except BaseException as err:  # noqa: BLE001 - re-raised by _finish
            upload.set_exception(storage_error(err))
        finally:
            written.set_result(None)
        cls._finish(upload, meta, tmp, path)

    @staticmethod
    def _finish(upload: Future, meta: dict[str, Any] | None, tmp: Path, path: Path) -> None:
        """Background: wait for every rank's files, then (rank 0, which holds ``meta``) put the directory in place."""
        try:
            upload.result()
            if meta is None:
                return
            with open(tmp / METADATA, "wb") as f:
                torch.save(meta, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp)
            replace_path(tmp, path)
            fsync_path(path.parent)
        except OSError as err:
            if meta is not None:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            if err.errno not in STORAGE_ERRNOS:
                raise
            raise CheckpointWriteError(
                f"could not write checkpoint {path} (in the background): {os.strerror(err.errno or 0)}; the "
                f"previous checkpoint is intact. Free space or fix the permissions, then rerun the same command "
                f"(resume=auto continues)",
                err.errno,
            ) from err

    def wait(self) -> None:
        """Block until the pending save (if any) is complete; its error, if it failed, is raised here."""
        self.wait_staged()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the pending save and release the host buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


class _Rest:
    """A place in a staged state dict for the ``index``-th tensor the stager copies."""

    def __init__(self, index: int):
        self.index = index


class AsyncCheckpointIO(AtomicCheckpointIO):
    """The checkpoint IO of a strategy whose rank 0 writes the whole state (one device, DDP): each checkpoint is
    written by an :class:`AsyncCheckpointWriter` as a DCP directory. ``strategy`` (set once the Trainer exists)
    gives the optimizers and the module whose parameter names key the optimizer state."""

    def __init__(self, reclaimable: Callable[[], list[Path]] | None = None, share: float = 1.0):
        super().__init__(reclaimable)
        self.writer = AsyncCheckpointWriter(share)
        self.strategy: Any = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        assert self.strategy is not None, "AsyncCheckpointIO.strategy is set by build_trainer"
        tensors = dcp_state(checkpoint, self.strategy.optimizers, self.strategy.lightning_module)
        self.writer.save(tensors, checkpoint, path, distributed=False, optimizers=self.strategy.optimizers)

    def teardown(self) -> None:
        self.writer.close()
