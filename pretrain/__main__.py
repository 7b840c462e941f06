"""``python -m pretrain COMMAND ...`` is the ``pretrain`` command."""

import sys

from pretrain.cli import main

sys.exit(main())
