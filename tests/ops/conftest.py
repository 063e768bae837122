"""URLs of every backend kind for the migration matrix; servers come from tests/conftest.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

_names = itertools.count()


@pytest.fixture
def make_url(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """make_url(kind) -> a fresh, empty store URL of that kind (mem, file, s3, redis)."""

    def make(kind: str) -> str:
        n = next(_names)
        if kind == "mem":
            return f"mem://ops-{n}"
        if kind == "file":
            return (tmp_path / f"disk-{n}").as_uri()
        if kind == "s3":
            return request.getfixturevalue("s3_url")()
        if kind == "redis":
            return request.getfixturevalue("redis_url")()
        raise ValueError(kind)

    return make
