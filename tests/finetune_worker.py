"""One rank of the finetuning strategy runs (``integration/test_finetune_strategies.py``): runs each finetuning
config of a JSON list in turn, as `pretrain finetune` runs it, in the process group the test's launcher set up
(RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment).

    python tests/finetune_worker.py CONFIGS.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(configs_json: str) -> None:
    import torch

    from pretrain.finetuning.config import validate

    torch.set_num_threads(1)  # two ranks on a shared CPU: tiny kernels, no OpenMP contention
    from pretrain.finetuning.run import run

    for raw in json.loads(Path(configs_json).read_text()):
        run(validate(raw))


if __name__ == "__main__":
    main(*sys.argv[1:])
