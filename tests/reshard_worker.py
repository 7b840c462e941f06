"""One rank of several ``pretrain fit`` runs (``test_reshard.py``), in the process group the test's launcher set up
(``training_utils.run_ranks``), separated by ``+`` as in ``fit_worker.py``; every training micro-batch's sample
indices are recorded in the run directory (``training_utils.record_sample_indices``).

    python tests/reshard_worker.py fit RECIPE [key=value ...] [+ fit RECIPE2 ...]
"""

from __future__ import annotations

import itertools
import sys

from training_utils import record_sample_indices

from pretrain.cli import main

if __name__ == "__main__":
    for owner, name, patched in record_sample_indices():
        setattr(owner, name, patched)
    args = sys.argv[1:]
    commands = [list(group) for plus, group in itertools.groupby(args, lambda a: a == "+") if not plus]
    for command in commands:
        if status := main(command):
            sys.exit(status)
