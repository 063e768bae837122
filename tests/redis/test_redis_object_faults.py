"""Redis: one bad key stays one object's miss (a key of the wrong type, a manifest
claiming more bytes than any object written here); batches are served around it and
listings go on, reporting what they could not read."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.backends import redis_layout as layout
from kvstore.cli.main import cli

MiB = 1 << 20


def items(n: int, size: int = 1000) -> list[tuple[str, bytes]]:
    return [(f"ns/m/vllm-1-0/o{i}", os.urandom(size)) for i in range(n)]


async def test_a_key_of_the_wrong_type_is_one_miss(redis_url) -> None:  # type: ignore[no-untyped-def]
    url = redis_url()
    b = open_backend(url)
    data = dict([*items(12), ("ns/m/vllm-1-0/big", os.urandom(2 * MiB))])
    assert all(await b.put_many(list(data.items())))
    bad = "ns/m/vllm-1-0/o5"
    key = layout.data_key(b.options.prefix, bad)
    await b.client.delete(key)
    await b.client.hset(key, "field", "value")  # someone else's hash at our object's key
    got = await b.get_many(list(data))
    assert [g is None for g in got] == [n == bad for n in data]
    assert all(bytes(g) == data[n] for n, g in zip(data, got) if g is not None)
    assert await b.contains_many(list(data)) == [n != bad for n in data]
    b._typical = 64 * MiB  # the big-object route: every object its own GET
    got = await b.get_many(list(data))
    assert [g is None for g in got] == [n == bad for n in data]
    listed = sorted([i.name async for i in b.list()])
    assert listed == sorted(n for n in data if n != bad)
    assert [u[0] for u in b.unlisted] == [bad]
    res = await asyncio.to_thread(CliRunner().invoke, cli, ["ls", url])
    assert res.exit_code == 1 and len([ln for ln in res.output.splitlines() if "h  ns/" in ln]) == 12
    await b.close()


async def test_a_manifest_claiming_huge_size_is_refused_before_allocating(redis_url) -> None:  # type: ignore[no-untyped-def]
    """Over the reader's max_object_size: a miss counted in `rejected`, found before any
    buffer is allocated, and left stored (another process may have written it under a
    larger limit); it was deleted."""
    b = open_backend(redis_url(max_object_size="1MiB"))
    data = dict(items(3))
    assert all(await b.put_many(list(data.items())))
    bad = "ns/m/vllm-1-0/o1"
    claim = layout.Manifest.new(100 << 30, 64 * MiB)
    await b.client.set(layout.data_key(b.options.prefix, bad), claim.encode())
    asked: list[int] = []

    def alloc(n: int) -> memoryview:
        asked.append(n)
        return memoryview(bytearray(n))

    got = await b.get_many(list(data), alloc)
    assert [g is None for g in got] == [False, True, False]
    assert max(asked) <= MiB
    assert await b.contains_many([bad]) == [True]  # still stored
    counters = b.stats().counters
    assert (counters.rejected, counters.quarantined, counters.deletes) == (1, 0, 0)
    assert await b.put_many([("ns/m/vllm-1-0/huge", os.urandom(2 * MiB))]) == [False]
    await b.close()


@pytest.mark.parametrize("route", ["sized", "big", "multi-part"])
async def test_a_value_over_the_readers_limit_is_refused_and_kept(redis_url, route: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """A store serving with a larger max_object_size wrote it; a reader with a smaller
    one (a plain URL) refuses it as a counted miss, says to raise the option, and leaves
    it stored, on every read route (sizes asked first, each object its own GET, a
    multi-part value's manifest)."""
    url = redis_url(part_size="2MiB") if route == "multi-part" else redis_url()
    writer = open_backend(f"{url}&max_object_size=8MiB")
    big, small = "ns/m/vllm-1-0/big", "ns/m/vllm-1-0/small"
    value = os.urandom(3 * MiB)
    assert all(await writer.put_many([(big, value), (small, b"s" * 100)]))
    reader = open_backend(f"{url}&max_object_size=1MiB")
    if route == "big":
        reader._typical = 64 * MiB
    got = await reader.get_many([big, small])
    assert got[0] is None and bytes(got[1]) == b"s" * 100
    counters = reader.stats().counters
    assert (counters.rejected, counters.quarantined) == (1, 0), counters
    assert "raise max_object_size" in caplog.text
    assert bytes(await writer.get(big)) == value  # still there, whole
    await reader.close()
    await writer.close()


@pytest.mark.parametrize("command", ["stat", "gc"])
def test_stat_and_gc_with_a_smaller_limit_leave_larger_objects(redis_url, command: str) -> None:  # type: ignore[no-untyped-def]
    """Header reads take no object into memory: `stat` and `gc` over a store holding
    objects larger than the URL's max_object_size (a store serving with a larger one)
    read their headers (a multi-part value's from its first part) and delete nothing;
    they went through whole-object reads that deleted every such object."""
    import json

    import torch

    from kvstore.keys import ChunkKey
    from kvstore.tier import Tier

    url = redis_url(part_size="1MiB")
    names = [ChunkKey("m", 1, 0, i).object_name() for i in range(3)]

    async def fill() -> None:
        tier = Tier.open(f"{url}&max_object_size=8MiB")
        sizes = (256, 1 << 19, 3 << 19)  # floats: 1 KiB, 2 MiB (one part), 6 MiB (multi-part)
        assert all(await tier.put_many([(n, torch.ones(k)) for n, k in zip(names, sizes)]))
        await tier.close()

    asyncio.run(fill())
    limited = f"{url}&max_object_size=1MiB"
    args = ["--json"] if command == "stat" else ["--older-than", "1h", "--json"]
    res = CliRunner().invoke(cli, [command, limited, *args])
    report = json.loads(res.output.splitlines()[0])
    if command == "stat":
        assert res.exit_code == 0 and report["unreadable"] == 0 and report["by_codec"]["raw"]["objects"] == 3
    else:
        assert res.exit_code == 0 and report["deleted"] == [] and report["before_objects"] == 3

    async def still() -> list[bool]:
        b = open_backend(url)
        try:
            return await b.contains_many(names)
        finally:
            await b.close()

    assert asyncio.run(still()) == [True] * 3


async def test_wrong_type_does_not_stop_verify(redis_url) -> None:  # type: ignore[no-untyped-def]
    url = redis_url()
    import torch

    from kvstore.tier import Tier

    tier = Tier.open(url)
    names = [f"ns/m/vllm-1-0/t{i}" for i in range(4)]
    assert all(await tier.put_many([(n, torch.ones(8)) for n in names]))
    client = tier.backend.client  # type: ignore[attr-defined]
    key = layout.data_key(tier.backend.options.prefix, names[2])  # type: ignore[attr-defined]
    await client.delete(key)
    await client.rpush(key, "x")
    got = await tier.get_many(names)
    assert [g is None for g in got] == [False, False, True, False]
    res = await asyncio.to_thread(CliRunner().invoke, cli, ["verify", url, "--json"])
    assert res.exit_code == 1 and '"ok": 3' in res.output
    await tier.close()
    assert isinstance(client, (aioredis.Redis, aioredis.RedisCluster))
