"""The `kvstore bench` baseline for Redis: plain redis-py SET/GET on the backend's URL."""

from __future__ import annotations

import os

from kvstore.throughput import baseline_for


async def test_baseline_round_trip_on_backend_url(redis_server):
    base = baseline_for(f"{redis_server.url}?ttl=5&part_size=4MiB")  # kvstore options are ignored
    await base.open(f"{redis_server.url}?ttl=5&part_size=4MiB")
    data = os.urandom(1 << 20)
    await base.put(7, memoryview(data))
    into = memoryview(bytearray(1 << 20))
    assert await base.get(7, into) == len(data) and bytes(into) == data
    await base.close()
    assert redis_server.command("DBSIZE").strip() == b":0"  # close() took its keys away


async def test_baseline_on_cluster_url(redis_cluster):
    base = baseline_for(redis_cluster.url)
    await base.open(redis_cluster.url)
    for i in range(10):
        await base.put(i, memoryview(bytes([i]) * 1000))
    into = memoryview(bytearray(1000))
    assert await base.get(9, into) == 1000 and bytes(into) == b"\x09" * 1000
    await base.close()
