"""One rank of ``pretrain ARGS`` in a process group set up by the test's launcher (``training_utils.run_ranks``:
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment, as torchrun sets them). Commands separated by
``+`` run one after the other in the same process group (one launch for several runs).

    python tests/integration/fit_worker.py fit RECIPE [key=value ...] [+ fit RECIPE2 ...]
"""

from __future__ import annotations

import itertools
import sys

from pretrain.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    commands = [list(group) for plus, group in itertools.groupby(args, lambda a: a == "+") if not plus]
    for command in commands:
        if status := main(command):
            sys.exit(status)
