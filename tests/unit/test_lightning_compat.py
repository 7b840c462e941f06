"""``lightning_compat`` says when an installed Lightning / DeepSpeed / torch is not the release its private
internals were tested with."""

from __future__ import annotations

import pytest

from pretrain.training import lightning_compat


def test_an_untested_release_is_named_in_one_warning(monkeypatch):
    tested = dict(lightning_compat.TESTED_WITH)
    installed = {**tested, "torch": f"{tested['torch']}+cpu", "lightning": "9.0.0"}
    monkeypatch.setattr(lightning_compat.metadata, "version", installed.__getitem__)
    assert lightning_compat.untested_versions() == {"lightning": "9.0.0"}  # +cpu is the same release
    with pytest.warns(UserWarning, match=r"lightning 9\.0\.0 \(tested: " + tested["lightning"]) as caught:
        lightning_compat.warn_if_untested()
    assert len(caught) == 1


def test_the_tested_releases_and_missing_packages_warn_nothing(monkeypatch, recwarn):
    def version(name):
        if name == "deepspeed":
            raise lightning_compat.metadata.PackageNotFoundError(name)
        return lightning_compat.TESTED_WITH[name]

    monkeypatch.setattr(lightning_compat.metadata, "version", version)
    lightning_compat.warn_if_untested()
    assert not recwarn.list
