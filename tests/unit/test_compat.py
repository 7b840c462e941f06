"""``pretrain.compat`` says when an installed Lightning / DeepSpeed / torch is not the release its private
internals were tested with (one table, one check)."""

from __future__ import annotations

import pytest

from pretrain import compat
from pretrain.compat import lightning as lightning_compat


def test_an_untested_release_is_named_in_one_warning(monkeypatch):
    tested = dict(compat.TESTED_WITH)
    installed = {**tested, "torch": f"{tested['torch']}+cpu", "lightning": "9.0.0"}
    monkeypatch.setattr(compat.metadata, "version", installed.__getitem__)
    assert compat.untested_versions() == {"lightning": "9.0.0"}  # +cpu is the same release
    with pytest.warns(UserWarning, match=r"lightning 9\.0\.0 \(tested: " + tested["lightning"]) as caught:
        compat.warn_if_untested()
    assert len(caught) == 1


def test_the_tested_releases_and_missing_packages_warn_nothing(monkeypatch, recwarn):
    def version(name):
        if name == "deepspeed":
            raise compat.metadata.PackageNotFoundError(name)
        return compat.TESTED_WITH[name]

    monkeypatch.setattr(compat.metadata, "version", version)
    compat.warn_if_untested()
    assert not recwarn.list


def test_a_peer_that_is_still_exiting_is_named_dead():
    """A killed peer's sockets close a moment before its exit status is readable: the rank is still named."""
    import subprocess
    import sys
    from types import SimpleNamespace

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    exiting = subprocess.Popen([sys.executable, "-c", "import time, os; time.sleep(0.5); os._exit(9)"])
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[alive, exiting])), node_rank=1, num_devices=3
    )
    try:
        assert lightning_compat.dead_ranks(trainer) == [5]  # node 1's third process: global rank 3 + 2
    finally:
        alive.kill()
        alive.wait()
        exiting.wait()
