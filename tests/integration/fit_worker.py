"""One rank of ``pretrain ARGS`` in a process group set up by the test's launcher (``training_utils.run_ranks``:
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment, as torchrun sets them).

    python tests/integration/fit_worker.py fit RECIPE [key=value ...]
"""

from __future__ import annotations

import sys

from pretrain.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
