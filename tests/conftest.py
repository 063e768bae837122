"""Project-wide test setup: every test gets its own KVSTORE_HOME."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _kvstore_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path_factory.mktemp("kvstore-home")))
