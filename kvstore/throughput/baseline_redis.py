"""Baseline for `kvstore bench redis://...`: plain redis-py SET / GET on the same server.

Owns: the plainest way to move one object through Redis with redis.asyncio (one key
per object, no pipelining, no parts), against which the Redis backend is measured.
Must not touch: kvstore backends.  Works for redis://, rediss://, unix:// and
redis+cluster:// URLs; kvstore's own URL options are ignored.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

_PASS = {"db", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}


def plain_client(url: str) -> Any:
    """A redis.asyncio client for a kvstore Redis URL (credentials as the backend takes them)."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    parts = urlsplit(url)
    user = unquote(parts.username) if parts.username else os.environ.get("KVSTORE_REDIS_USERNAME")
    password = unquote(parts.password) if parts.password else os.environ.get("KVSTORE_REDIS_PASSWORD")
    query = {k: v for k, v in parse_qsl(parts.query) if k in _PASS}
    hosts = parts.netloc.rsplit("@", 1)[-1]
    if parts.scheme.endswith("+cluster"):
        nodes = [ClusterNode(h.rpartition(":")[0], int(h.rpartition(":")[2])) for h in hosts.split(",")]
        return RedisCluster(
            startup_nodes=nodes, username=user, password=password, ssl=parts.scheme.startswith("rediss")
        )
    plain = urlunsplit((parts.scheme, hosts, parts.path, urlencode(query), ""))
    return aioredis.Redis.from_url(plain, username=user, password=password)


class Baseline:
    """redis-py SET/GET of one key per object (`Baseline` protocol of kvstore.throughput)."""

    name = "redis-py SET/GET"

    def __init__(self, key_prefix: str = "kvbench:baseline:") -> None:
        self.key_prefix = key_prefix
        self.client: Any = None
        self._written: set[int] = set()

    async def open(self, url: str) -> None:
        self.client = plain_client(url)

    async def put(self, i: int, data: memoryview) -> None:
        await self.client.set(f"{self.key_prefix}{i}", data)
        self._written.add(i)

    async def get(self, i: int, into: memoryview) -> int:
        data = await self.client.get(f"{self.key_prefix}{i}")
        if data is None:
            raise KeyError(f"baseline object {i} is missing; put it first")
        into[: len(data)] = data
        return len(data)

    async def close(self) -> None:
        """Delete the keys this baseline wrote (best effort), then disconnect."""
        if self.client is not None:
            for i in self._written:
                try:
                    await self.client.unlink(f"{self.key_prefix}{i}")
                except Exception:  # cleanup only: a server gone by now has nothing to keep
                    break
            self._written.clear()
            await self.client.aclose()
            self.client = None
