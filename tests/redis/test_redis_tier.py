"""Tensors through a Tier on the Redis backend: frames as gathered parts, corruption as a miss."""

from __future__ import annotations

import pytest
import redis
import torch

from kvstore.backends.redis import RedisBackend
from kvstore.backends.redis_layout import data_key
from kvstore.keys import ChunkKey
from kvstore.tier import Tier
from tests.redis.conftest import FAST

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


async def test_tensors_round_trip_single_and_multi_part(redis_server):
    backend = RedisBackend.from_url(f"{redis_server.url}?part_size=1MiB&{FAST}")
    async with Tier(backend) as tier:
        small = torch.randn(2, 8, 16, dtype=torch.float16)
        big = torch.randn(4, 2, 256, 2, 64).to(torch.bfloat16)  # 1 MiB payload + header: 2 parts
        names = [ChunkKey("m", 1, 0, h).object_name() for h in (1, 2)]
        assert await tier.put_many(list(zip(names, [small, big]))) == [True, True]
        got = await tier.get_many([*names, ChunkKey("m", 1, 0, 3).object_name()])
        assert torch.equal(got[0], small) and torch.equal(got[1], big) and got[2] is None


async def test_corrupted_value_is_quarantined_as_a_miss(redis_server):
    backend = RedisBackend.from_url(f"{redis_server.url}?{FAST}")
    async with Tier(backend) as tier:
        name = ChunkKey("m", 1, 0, 7).object_name()
        t = torch.arange(4096, dtype=torch.float32)
        assert await tier.put_many([(name, t)]) == [True]
        r = redis.Redis(host=redis_server.host, port=redis_server.port)
        raw = bytearray(r.get(data_key("kv:", name)))
        raw[-1] ^= 0xFF  # flip a payload byte
        r.set(data_key("kv:", name), bytes(raw))
        assert await tier.get_many([name]) == [None]
        assert tier.counters.corrupt == 1
        assert r.exists(data_key("kv:", name)) == 0  # quarantine removed it


async def test_ttl_by_namespace_from_configuration(redis_server):
    b = RedisBackend.from_url(f"{redis_server.url}?ttl.b=30&{FAST}", ttl_by_namespace={"a": 10, "b": 99})
    assert await b.put_many([("a/m/f-1-0/x", b"1"), ("b/m/f-1-0/x", b"2"), ("c/m/f-1-0/x", b"3")])
    r = redis.Redis(host=redis_server.host, port=redis_server.port)
    assert 9_000 < r.pttl(data_key("kv:", "a/m/f-1-0/x")) <= 10_000
    assert 29_000 < r.pttl(data_key("kv:", "b/m/f-1-0/x")) <= 30_000  # the URL wins
    assert r.pttl(data_key("kv:", "c/m/f-1-0/x")) == -1
    await b.close()
