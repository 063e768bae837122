"""Redis: one bad key stays one object's miss (a key of the wrong type, a manifest
claiming more bytes than any object written here); batches are served around it and
listings go on, reporting what they could not read."""

from __future__ import annotations

import asyncio
import os

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


async def test_a_manifest_claiming_huge_size_is_quarantined_before_allocating(redis_url) -> None:  # type: ignore[no-untyped-def]
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
    assert await b.contains_many([bad]) == [False]  # quarantined (deleted)
    assert b.stats().counters.quarantined == 1
    assert await b.put_many([("ns/m/vllm-1-0/huge", os.urandom(2 * MiB))]) == [False]
    await b.close()


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
