"""Redis reads that land straight in the caller's tensor (`RedisBackend.read_streamed`).

Through a TieredStore with every ``out`` given, the way the LMCache plugins and the L2
adapter read: bytes equal for tiny and big values, on TCP, a unix socket with a
password and a database number, and multi-part values; a flipped byte, a frame under
another name and a key of another type are misses, never wrong data; a hung server is
a miss within the deadline and the socket is not reused half-read.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvstore.testing.redis_server import RedisServer, redis_available
from kvstore.tiered import TieredStore
from tests.support.required import REDIS_INSTALL, needs

pytestmark = needs(redis_available(), "redis-server", REDIS_INSTALL)

NAMES = [f"ns/m/f-1-0/{i}" for i in range(4)]


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, generator=g),  # a frame smaller than the first read
        torch.randn(1000, generator=g).to(torch.bfloat16),
        torch.randn(2, 4, 256, 1024, generator=g).to(torch.bfloat16),  # 4 MiB
        torch.randn(3, 1 << 20, generator=g),  # 12 MiB
    ]


async def round_trip(url: str) -> TieredStore:
    st = TieredStore.from_urls([url])
    data = tensors()
    assert await st.put_many(list(zip(NAMES, data))) == [True] * 4
    st2 = TieredStore.from_urls([url], discover=True)  # reads what another process stored
    outs = [torch.zeros_like(t) for t in data]
    got = await st2.get_many(NAMES, out=outs)
    for t, o, g in zip(data, outs, got):
        assert g is o and torch.equal(o, t)
    assert st2.tiers[0].backend.streams is not None or "cluster" in url
    await st.close()
    return st2


@pytest.mark.parametrize("kind", ["tcp", "unix-password-db", "multipart"])
async def test_streamed_reads_are_bytes_equal(tmp_path, kind):
    with RedisServer(unix_socket=kind != "tcp", password="pw-1" if kind != "tcp" else None) as srv:
        url = srv.url
        if kind == "unix-password-db":
            url += "?db=3"
        if kind == "multipart":
            url += "?part_size=1MiB"
        st = await round_trip(url)
        if kind == "unix-password-db":
            assert b"db3:keys=4" in srv.command("INFO", "keyspace")
        await st.close()


async def test_defects_are_misses_not_wrong_data(tmp_path):
    with RedisServer() as srv:
        st = TieredStore.from_urls([srv.url], discover=True)
        data = tensors()
        assert all(await st.put_many(list(zip(NAMES, data))))
        srv.command("SETRANGE", "kv:{ns/m/f-1-0/2}", "4000", "XYZ")  # flip payload bytes
        srv.command("RENAME", "kv:{ns/m/f-1-0/3}", "kv:{ns/m/f-1-0/9}")  # ns/.../9 holds 3's frame
        srv.command("DEL", "kv:{ns/m/f-1-0/1}")
        srv.command("RPUSH", "kv:{ns/m/f-1-0/1}", "not a value")  # a key of another type
        fresh = TieredStore.from_urls([srv.url], discover=True)
        names = [NAMES[0], NAMES[1], NAMES[2], "ns/m/f-1-0/9"]
        shapes = [data[0], data[1], data[2], data[3]]
        outs = [torch.zeros_like(t) for t in shapes]
        got = await fresh.get_many(names, out=outs)
        assert got[0] is outs[0] and torch.equal(outs[0], data[0]), "the healthy object is still served"
        assert got[1:] == [None, None, None]
        assert fresh.tiers[0].counters.corrupt >= 2  # the flipped and the misplaced frame
        await st.close()
        await fresh.close()


async def test_a_hung_server_is_a_miss_within_the_deadline():
    with RedisServer() as srv:
        url = f"{srv.url}?timeout=1&connect_timeout=0.5"
        st = TieredStore.from_urls([url], discover=True, tier_timeout=1.0)
        data = tensors()
        assert all(await st.put_many(list(zip(NAMES, data))))
        backend = st.tiers[0].backend
        srv.pause()
        try:
            outs = [torch.zeros_like(t) for t in data]
            t = time.monotonic()
            got = await st.get_many(NAMES, out=outs)
            assert got == [None] * 4 and time.monotonic() - t < 3
            assert backend.streams._idle == [], "a socket left mid-reply is never reused"
        finally:
            srv.resume()
        await asyncio.sleep(1.1)  # the tier's breaker lets a probe through again
        outs = [torch.zeros_like(t) for t in data]
        assert all(g is not None for g in await st.get_many(NAMES, out=outs))
        await st.close()
