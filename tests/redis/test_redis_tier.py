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


def _corrupt(r: redis.Redis, name: str) -> None:
    raw = bytearray(r.get(data_key("kv:", name)))
    raw[-1] ^= 0xFF  # flip a payload byte
    r.set(data_key("kv:", name), bytes(raw))


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("rewritten", [False, True], ids=["corrupt", "rewritten-after-the-read"])
async def test_a_corrupt_read_quarantines_only_the_copy_it_read(redis_server, streamed, rewritten):
    """An engine read that finds a value corrupt takes it out of service, read whole or
    streamed into the caller's tensor; a good copy another process wrote after that read
    (a rewrite, a repair) stays and serves the next read."""
    backend = RedisBackend.from_url(f"{redis_server.url}?{FAST}")
    async with Tier(backend) as tier:
        name = ChunkKey("m", 1, 0, 8).object_name()
        t = torch.arange(4096, dtype=torch.float32)
        assert await tier.put_many([(name, t)]) == [True]
        r = redis.Redis(host=redis_server.host, port=redis_server.port)
        good = r.get(data_key("kv:", name))
        _corrupt(r, name)
        method = "read_streamed" if streamed else "get_many"
        read = getattr(backend, method)

        async def read_then_another_process_rewrites(*args, **kw):  # type: ignore[no-untyped-def]
            got = await read(*args, **kw)
            if rewritten:
                r.set(data_key("kv:", name), good)
            return got

        setattr(backend, method, read_then_another_process_rewrites)
        out = [torch.zeros_like(t)] if streamed else None
        assert await tier.get_many([name], out=out) == [None]
        assert tier.counters.corrupt == 1
        setattr(backend, method, read)
        assert r.exists(data_key("kv:", name)) == int(rewritten)
        assert backend.counters.quarantined == int(not rewritten)
        if rewritten:
            (got,) = await tier.get_many([name], out=[torch.zeros_like(t)] if streamed else None)
            assert got is not None and torch.equal(got, t)


async def test_ttl_by_namespace_from_configuration(redis_server):
    b = RedisBackend.from_url(f"{redis_server.url}?ttl.b=30&{FAST}", ttl_by_namespace={"a": 10, "b": 99})
    assert await b.put_many([("a/m/f-1-0/x", b"1"), ("b/m/f-1-0/x", b"2"), ("c/m/f-1-0/x", b"3")])
    r = redis.Redis(host=redis_server.host, port=redis_server.port)
    assert 9_000 < r.pttl(data_key("kv:", "a/m/f-1-0/x")) <= 10_000
    assert 29_000 < r.pttl(data_key("kv:", "b/m/f-1-0/x")) <= 30_000  # the URL wins
    assert r.pttl(data_key("kv:", "c/m/f-1-0/x")) == -1
    await b.close()


async def test_a_redis_outage_keeps_its_names_while_the_disk_copy_below_serves(redis_server, tmp_path):
    """Redis down: a read of its names fails (counted), which is no proof they are gone:
    they stay on Redis's books, the write-through disk copy serves them, and on_gone hears
    nothing. Back up empty (no persistence): found gone without an error, they are off
    Redis's books, and the disk copy serves them in the same read (then promotes them
    back: Redis's books and Redis agree)."""
    from kvstore.tiered import TieredStore

    store = TieredStore.from_urls([f"{redis_server.url}?{FAST}", f"file://{tmp_path}?fsync=false&write=through"])
    gone: list[str] = []
    store.on_gone = gone.extend
    name = ChunkKey("m", 1, 0, 9).object_name()
    t = torch.arange(4096, dtype=torch.float32)
    assert await store.put_many([(name, t)]) == [True]
    await store.drain()
    redis_server.kill()
    for _ in range(4):
        (got,) = await store.get_many([name])
        assert got is not None and torch.equal(got, t)
        assert name in store.placement.tiers[0].resident and gone == []
    redis_server.start()  # same port, empty
    for _ in range(3):  # found gone in Redis (no error now): served from disk, promoted back
        (got,) = await store.get_many([name])
        assert got is not None and torch.equal(got, t)
    await store.drain()
    assert gone == [] and name in store.placement.tiers[1].resident
    assert await store.tiers[0].backend.contains_many([name]) == [name in store.placement.tiers[0].resident]
    await store.close()


async def test_a_frame_that_disagrees_with_itself_is_quarantined_on_a_streamed_read(redis_server):
    """A raw frame whose payload is not as long as its header's shape says (sound
    checksum and key) is refused by a read into the caller's tensor, and taken out of
    service: read back, it still fails that read's checks."""
    from kvstore.frame import encode_frame

    backend = RedisBackend.from_url(f"{redis_server.url}?{FAST}")
    async with Tier(backend) as tier:
        name = ChunkKey("m", 1, 0, 9).object_name()
        parts = encode_frame([b"\x01" * 100], codec="raw", dtype="float32", shape=(10,), key=name)
        r = redis.Redis(host=redis_server.host, port=redis_server.port)
        r.set(data_key("kv:", name), b"".join(bytes(p) for p in parts))
        assert await tier.get_many([name], out=[torch.zeros(10)]) == [None]
        assert tier.counters.corrupt == 1
        assert r.exists(data_key("kv:", name)) == 0
