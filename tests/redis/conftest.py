"""Fixtures for the Redis tier tests: a real redis-server per test, one 3-master Cluster per session."""

from __future__ import annotations

import pytest

from kvstore.testing.redis_server import RedisClusterProcs, RedisServer, redis_available
from tests.support.required import REDIS_INSTALL, require

# Quick deadlines so fault tests take seconds: connect 0.5 s, batch 2 s.
FAST = "timeout=2&connect_timeout=0.5"


@pytest.fixture
def redis_server():
    require(redis_available(), "redis-server", REDIS_INSTALL)
    with RedisServer() as srv:
        yield srv


@pytest.fixture
async def backend(redis_server):
    from kvstore.backends import open_backend

    b = open_backend(f"{redis_server.url}?{FAST}")
    yield b
    await b.close()


@pytest.fixture(scope="session")
def redis_cluster():
    require(redis_available(cluster=True), "redis-server and redis-cli", REDIS_INSTALL)
    with RedisClusterProcs(masters=3) as cluster:
        yield cluster
