"""The best-k checkpoints of a run, whose record follows the run directory when it is moved or copied."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint


class BestCheckpoints(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, resumable from a run directory that was moved, renamed or copied.

    Lightning forgets the saved best-k record whenever the checkpoint directory's path differs from the one saved:
    a resumed run in ``runs/new`` (copied from ``runs/old``) then kept a second "best" file next to the first with
    ``save_top_k=1`` and reported a worse checkpoint than the one it had as its best. Here the record is carried
    over by file name: the files it names that are in this directory keep their scores (the best and the k-th best
    ranked again from them); those that are not are dropped, with a warning."""

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key (Lightning keys a callback's saved state by its class name): checkpoints
        written before this class and by it read each other's record."""
        return "ModelCheckpoint" + super().state_key.removeprefix(type(self).__qualname__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("dirpath")
        if saved is not None and self.dirpath is not None and saved != self.dirpath:
            state_dict = self._moved(state_dict, Path(saved), Path(self.dirpath))
        super().load_state_dict(state_dict)

    def _moved(self, state: dict[str, Any], old: Path, new: Path) -> dict[str, Any]:
        """``state`` with its paths under ``old`` moved to ``new``, keeping the files ``new`` holds."""
        scores = {}
        for path, score in state.get("best_k_models", {}).items():
            moved = new / Path(path).name
            if Path(path).parent == old and moved.is_file():
                scores[str(moved)] = score
        dropped = len(state.get("best_k_models", {})) - len(scores)
        if dropped:
            warnings.warn(
                f"{dropped} best checkpoint(s) recorded in {old} are not in {new}: checkpoint.save_top_k ranks "
                "the ones that are (and the checkpoints to come)",
                stacklevel=2,
            )
        state = dict(state, dirpath=self.dirpath, best_k_models=scores, last_model_path="")
        if not scores:  # this callback's own (unset) record
            return dict(
                state,
                best_model_path=self.best_model_path,
                best_model_score=self.best_model_score,
                kth_best_model_path=self.kth_best_model_path,
                kth_value=self.kth_value,
            )
        better, worse = (min, max) if self.mode == "min" else (max, min)
        best, kth = (
            better(scores, key=lambda p: float(scores[p])),
            worse(scores, key=lambda p: float(scores[p])),
        )
        return dict(
            state,
            best_model_path=best,
            best_model_score=scores[best],
            kth_best_model_path=kth,
            kth_value=scores[kth],
        )
