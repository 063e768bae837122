"""Contracts between the tiered store's parts: declared backend capabilities, one
transcode for copies and migrations, and the in-flight tickets."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.backends import open_backend
from kvstore.backends.base import Backend, Capabilities
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import MemoryBackend
from kvstore.backends.redis import RedisBackend
from kvstore.backends.s3 import S3Backend
from kvstore.codec import get as get_codec
from kvstore.policy import Copy
from kvstore.tier import DECLINED, HIT, Tier, transcode
from kvstore.tiered import TieredStore
from kvstore.tiered.inflight import InFlight


def test_backends_declare_their_capabilities() -> None:
    assert Backend.capabilities == Capabilities()
    assert MemoryBackend.capabilities.in_memory and not MemoryBackend.capabilities.streamed_reads
    assert DiskBackend.capabilities.streamed_reads and not DiskBackend.capabilities.streams_on_loop
    assert RedisBackend.capabilities.streamed_reads and RedisBackend.capabilities.streams_on_loop
    assert RedisBackend.capabilities.server_ttl
    assert S3Backend.capabilities.streamed_reads and not S3Backend.capabilities.streams_on_loop
    assert S3Backend.capabilities.ranged_reads
    narrowed = S3Backend("s3://b/p?stream=false").capabilities  # an instance narrows its class's
    assert not narrowed.streamed_reads and narrowed.ranged_reads


async def test_a_backend_without_streamed_reads_refuses_them() -> None:
    be = open_backend("mem://")
    with pytest.raises(NotImplementedError):
        await be.read_streamed(["a"], lambda _n: None)  # type: ignore[arg-type, return-value]


async def test_transcode_keeps_the_tensor_and_names_its_source() -> None:
    tier = Tier.open("mem://")
    t = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    assert await tier.put_many([("ns/x", t)], layout="L") == [True]
    (frame,) = await tier.get_frames(["ns/x"])
    assert frame is not None
    parts = transcode(frame, "ns/x", get_codec("raw"))
    payload = b"".join(bytes(p) for p in parts[1:])  # the header holds a time; the payload is the same
    assert payload == b"".join(bytes(p) for p in tier.transcode(frame, "ns/x", get_codec("raw"))[1:])
    other = Tier.open("mem://")
    assert await other.put_frames([("ns/x", parts)]) == [True]
    (again,) = await other.get_frames(["ns/x"])
    assert again is not None and again.header.meta["source_csum"] == frame.header.csum
    assert again.header.layout == "L"
    (back,) = await other.get_many(["ns/x"])
    assert back is not None and torch.equal(back, t)


async def test_read_into_counts_each_outcome_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.buffers import BufferPool

    tier = Tier(DiskBackend(tmp_path, fsync=False))
    t = torch.ones(8)
    await tier.put_many([("ns/a", t), ("ns/b", t)])
    outs = [torch.empty(8), lambda _h: None]
    got = await tier.read_into(["ns/a", "ns/b"], outs, BufferPool())
    assert [r.status for r in got] == [HIT, DECLINED]
    c = tier.counters
    assert (c.hits, c.declined, c.misses) == (2, 1, 0)
    assert tier.capabilities.streamed_reads


async def test_inflight_tickets() -> None:
    now = [0.0]
    fl = InFlight(lambda: now[0])
    r = fl.prepare_read(["a", "a", "b"])
    assert "a" in fl and "b" in fl and "c" not in fl
    fl.complete(r)
    assert "a" not in fl
    fl.complete(r)  # twice: a no-op
    fl.pin(["p"], until=5.0)
    assert "p" in fl
    now[0] = 6.0
    assert "p" not in fl and fl.pinned(now[0]) == 0

    w = fl.prepare_write()
    fl.add_write(w, "n")
    fl.add_write(w, "n")  # two tiers
    assert fl.writing("n") and fl.busy("n")
    fl.wrote(w, "n")
    assert fl.writing("n")
    c = fl.prepare_copy(Copy("demote", "n", 1, 0, 1))
    assert fl.source("n", 1) == 0 and fl.copying("n")
    order: list[str] = []

    async def copy() -> None:
        async with fl.turn(c, asyncio.Semaphore(1)) as src:
            order.append(f"copy from {src}")

    task = asyncio.ensure_future(copy())
    await asyncio.sleep(0)
    assert order == []  # waits for the write batch to land
    fl.complete(w)  # the write never reported is released too
    await task
    assert order == ["copy from 0"] and not fl.writing("n")
    assert fl.complete(c) is True  # the name's last copy
    assert fl.source("n", 1) == 1 and not fl.busy("n")


async def test_store_exposes_its_parts_through_public_faces() -> None:
    st = TieredStore.from_urls(["mem://"])
    seen: list[list[str]] = []
    st.on_gone = seen.append
    assert st.on_gone is not None and st.tier_available(0) and len(st.breakers) == 1
    await st.put_many([("ns/g", torch.ones(2))])
    assert await st.delete_many(["ns/g"]) == [True]
    assert seen == [["ns/g"]]
    await st.close()


async def test_wait_out_outlasts_repeated_cancels() -> None:
    from kvstore.backends.stream import wait_out

    loop = asyncio.get_running_loop()
    work = loop.create_future()  # a worker's job, still writing
    waiter = asyncio.ensure_future(wait_out(work))
    for _ in range(3):
        await asyncio.sleep(0.01)
        waiter.cancel()  # a second and third cancel must not let the waiter leave early
    await asyncio.sleep(0.05)
    assert not waiter.done()
    work.set_result(None)
    await asyncio.wait({waiter})
    assert waiter.done()
