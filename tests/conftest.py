"""Project-wide test setup: every test gets its own KVSTORE_HOME; shared servers.

Servers start only when a test asks for them, once per session:
`seaweed` / `s3_env` / `s3_url` (SeaweedFS S3 on loopback), `redis_session` / `redis_url`
(one redis-server; each URL gets its own key prefix).
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvstore.testing.redis_server import RedisServer, redis_available
from kvstore.testing.seaweed import SeaweedS3, weed_binary
from tests.support.required import REDIS_INSTALL, SEAWEED_INSTALL, require


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(available, what, install): skip without it, FAIL in CI (tests/support/required.py)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        require(mark.kwargs["available"], mark.kwargs["what"], mark.kwargs["install"])


@pytest.fixture(autouse=True)
def _kvstore_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path_factory.mktemp("kvstore-home")))


_prefixes = itertools.count()


@pytest.fixture(scope="session")
def seaweed():
    require(weed_binary() is not None, "SeaweedFS (weed)", SEAWEED_INSTALL)
    with SeaweedS3() as server:
        server.create_bucket("kvstore-test")
        yield server


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """The server's credentials in the standard AWS environment variables."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed


@pytest.fixture
def s3_url(s3_env):
    """A fresh prefix in the test bucket for each test (so tests never see each other's keys)."""

    def make(**options) -> str:
        return s3_env.url("kvstore-test", f"t{os.getpid()}-{next(_prefixes)}", **options)

    return make


@pytest.fixture(scope="session")
def redis_session():
    require(redis_available(), "redis-server", REDIS_INSTALL)
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_url(redis_session):
    """A Redis URL with a fresh key prefix for each call (tests never see each other's keys)."""

    def make(**options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"prefix": f"t{next(_prefixes)}:", **options}.items())
        return f"{redis_session.url}?{query}"

    return make
