"""Redis Cluster (3 masters started by the test): round trip, fan-out, one slot per object."""

from __future__ import annotations

import os

import pytest
import redis

from kvstore.backends import open_backend
from kvstore.backends.base import Defect
from kvstore.backends.redis_layout import data_key, parts_key
from kvstore.testing.redis_server import redis_available
from tests.support.required import REDIS_INSTALL, needs

pytestmark = [
    pytest.mark.filterwarnings("error::RuntimeWarning"),
    needs(redis_available(cluster=True), "redis-server and redis-cli", REDIS_INSTALL),
]
MiB = 1 << 20


def node_clients(cluster) -> list[redis.Redis]:
    return [redis.Redis(host=n.host, port=n.port) for n in cluster.nodes]


async def test_cluster_round_trip_fans_out_to_every_master(redis_cluster):
    for c in node_clients(redis_cluster):
        c.flushall()
    b = open_backend(f"{redis_cluster.url}?part_size=1MiB&timeout=5")
    small = [(f"ns/m/vllm-1-0/{i}", os.urandom(512 + i)) for i in range(60)]
    big = [(f"ns/m/vllm-1-0/big{i}", os.urandom(2 * MiB + i)) for i in range(4)]  # multi-part
    mid = [("ns/m/vllm-1-0/mid", os.urandom(900 * 1024))]
    framed = [(f"ns/m/vllm-1-0/f{i}", [b"HEADER", os.urandom(100 * 1024 + i)]) for i in range(6)]
    items = small + big + mid + framed
    assert await b.put_many(items) == [True] * len(items)
    got = await b.get_many([n for n, _ in items])
    assert [bytes(g) for g in got] == [v if isinstance(v, bytes) else b"".join(v) for _, v in items]
    kinds = {type(c).__name__ for n in b.client.get_nodes() for c in n._connections}
    assert kinds == {"GatheringConnection"}, kinds  # framed values went out unjoined
    # the batch spread over all three masters
    per_node = [c.dbsize() for c in node_clients(redis_cluster)]
    assert all(k > 0 for k in per_node) and sum(per_node) == len(items) + len(big)
    # every key of one object is in one slot (parts hash next to its manifest)
    c0 = node_clients(redis_cluster)[0]
    for name, _ in big:
        slots = {c0.execute_command("CLUSTER KEYSLOT", k("kv:", name)) for k in (data_key, parts_key)}
        assert len(slots) == 1
    listed = {i.name: i.size async for i in b.list("ns/")}
    assert listed == {n: len(v) if isinstance(v, bytes) else sum(map(len, v)) for n, v in items}
    assert await b.contains_many([items[0][0], "ns/m/vllm-1-0/none"]) == [True, False]
    assert await b.delete_many([n for n, _ in items]) == [True] * len(items)
    assert sum(c.dbsize() for c in node_clients(redis_cluster)) == 0
    st = await b.refresh_stats()
    assert st.extra["cluster"] is True and st.extra["server_keys"] == 0
    await b.close()


async def test_cluster_node_down_is_counted_then_recovers(redis_cluster):
    b = open_backend(f"{redis_cluster.url}?timeout=1&connect_timeout=0.3")
    names = [f"ns/m/vllm-1-0/d{i}" for i in range(30)]
    assert all(await b.put_many([(n, n.encode()) for n in names]))
    victim = redis_cluster.nodes[1]
    victim.kill()
    try:
        got = await b.get_many(names)
        assert any(g is None for g in got) or b.counters.get_errors > 0
        assert all(g is None or bytes(g) == n.encode() for n, g in zip(names, got))
        assert b.counters.get_errors > 0
    finally:
        victim.start()
        redis_cluster.wait_ok()
    ok = await b.put_many([(n, n.encode()) for n in names])
    assert all(ok)
    assert [bytes(g) for g in await b.get_many(names)] == [n.encode() for n in names]
    await b.close()


@pytest.mark.parametrize("size", [300 * 1024, 3 * MiB])  # one value; parts (part_size=1MiB)
async def test_cluster_quarantine_deletes_what_it_compared_and_keeps_a_rewrite(redis_cluster, size):
    """On a cluster, verify's quarantine deletes the value (and a multi-part one's parts)
    when it still holds the bytes read, and deletes nothing when another copy is there."""
    b = open_backend(f"{redis_cluster.url}?part_size=1MiB&timeout=5")
    name = f"ns/m/vllm-1-0/q{size}"
    bad, good = os.urandom(size), os.urandom(size)
    assert await b.put_many([(name, bad)]) == [True]
    assert await b.quarantine(name, "test", Defect(read=good)) is False  # not what it holds
    got = await b.get(name)
    assert got is not None and bytes(got) == bad
    assert await b.quarantine(name, "test", Defect(read=bad)) is True
    assert await b.contains_many([name]) == [False]
    assert await b.client.exists(data_key("kv:", name), parts_key("kv:", name)) == 0  # (one slot: {name})
    assert b.counters.quarantined == 1
    await b.close()
