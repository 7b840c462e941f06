"""Token shards for tests, written as ``pretrain prepare`` writes them: ``IndexedWriter.add_documents``."""

from __future__ import annotations

import numpy as np

from pretrain.datamodules.indexed import IndexedWriter


def write_shard(prefix, docs, dtype) -> None:
    """``docs`` (each a sequence of token ids) as one indexed dataset ``prefix.bin/.idx``."""
    docs = [np.asarray(d) for d in docs]
    with IndexedWriter(prefix, dtype) as writer:
        if docs:
            writer.add_documents(np.concatenate(docs), np.array([len(d) for d in docs]))
