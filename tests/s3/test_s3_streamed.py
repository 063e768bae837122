"""S3 reads that land straight in the caller's tensor (presigned GETs on worker threads),
against a real SeaweedFS: bytes equal, large objects in parallel ranges, misses and
corrupt or misplaced objects refused, faults retried or counted, cancels that wait."""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import urlencode

import aiobotocore.session
import pytest
import torch

from kvstore.backends.s3 import S3Backend
from kvstore.testing.fault_proxy import Fault, FaultProxy
from kvstore.testing.seaweed import SeaweedS3
from kvstore.tiered import TieredStore

BUCKET = "kvstore-test"  # the session's SeaweedFS bucket (tests/conftest.py)
MiB = 1 << 20


@pytest.fixture
def server(seaweed):
    return seaweed


@pytest.fixture
def env(s3_env, monkeypatch):
    for k in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(k, raising=False)
    return s3_env


def url_for(endpoint: str, prefix: str, **options) -> str:
    opts = {"endpoint_url": endpoint, "region": "us-east-1", "connect_timeout": 0.5, "read_timeout": 2}
    return f"s3://{BUCKET}/streamed-{os.getpid()}-{prefix}?" + urlencode({**opts, **options})


def store(endpoint: str, prefix: str, **options) -> TieredStore:
    return TieredStore.from_urls([url_for(endpoint, prefix, **options)])


def backend_of(st: TieredStore) -> S3Backend:
    b = st.tiers[0].backend
    assert isinstance(b, S3Backend)
    return b


def ints(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), (1 << 31) - 1, shape, dtype=torch.int32, generator=g)


async def test_streamed_reads_land_in_out_bytes_equal_with_ranges_for_large_objects(env):
    st = store(env.endpoint, "eq")
    b = backend_of(st)
    assert b.capabilities.streamed_reads
    small, mid, big = ints(32, 1024), ints(1024, 1024, seed=1), ints(10 * 1024, 1024, seed=2)  # 128 KiB, 4, 40 MiB
    names = ["ns/m/f-1-0/1", "ns/m/f-1-0/2", "ns/m/f-1-0/3"]
    assert await st.put_many(list(zip(names, [small, mid, big]))) == [True] * 3
    streams, _ = b._stream_pool()
    sent, again = streams.requests, streams.retries  # the puts went through it too
    outs = [torch.zeros_like(t) for t in (small, mid, big)]
    got = await st.get_many(names, out=outs)
    assert all(g is o for g, o in zip(got, outs))
    assert torch.equal(outs[0], small) and torch.equal(outs[1], mid) and torch.equal(outs[2], big)
    assert st.pool.pooled_bytes == 0, "streamed: no intermediate buffer"
    # one GET each for the first two; the 40 MiB payload and its header: 16 MiB first, then
    # three 8 MiB ranges and a short one
    assert (streams.requests - sent, streams.retries - again) == (2 + 5, 0)
    assert b.counters.hits == 3 and b.counters.get_bytes >= big.numel() * 4
    await st.close()


async def test_one_get_per_object_when_range_threshold_is_large(env):
    st = store(env.endpoint, "one", range_threshold="1GiB")
    big = ints(10 * 1024, 1024, seed=3)
    await st.put_many([("ns/m/f-1-0/9", big)])
    streams, _ = backend_of(st)._stream_pool()
    sent = streams.requests
    out = torch.zeros_like(big)
    assert (await st.get_many(["ns/m/f-1-0/9"], out=[out]))[0] is out
    assert torch.equal(out, big)
    assert streams.requests - sent == 1
    await st.close()


async def _raw_put(server: SeaweedS3, key: str, data: bytes) -> None:
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **server.client_kwargs()) as client:
        await client.put_object(Bucket=BUCKET, Key=key, Body=data)


async def _raw_get(server: SeaweedS3, key: str) -> bytes:
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **server.client_kwargs()) as client:
        resp = await client.get_object(Bucket=BUCKET, Key=key)
        return await resp["Body"].read()


async def test_an_object_gone_from_the_bucket_is_a_counted_miss(env):
    st = store(env.endpoint, "miss")
    b = backend_of(st)
    t = ints(4, 4)
    await st.put_many([("ns/m/f-1-0/gone", t)])
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **env.client_kwargs()) as client:  # e.g. a lifecycle rule
        await client.delete_object(Bucket=BUCKET, Key=b.options.key("ns/m/f-1-0/gone"))
    assert await st.get_many(["ns/m/f-1-0/gone"], out=[torch.zeros_like(t)]) == [None]
    assert (b.counters.gets, b.counters.misses, b.counters.get_errors) == (1, 1, 0)
    await st.close()


@pytest.mark.parametrize("size_mib", [1, 40])
async def test_a_flipped_bit_is_a_quarantined_miss_in_the_first_part_or_a_range(env, size_mib):
    st = store(env.endpoint, f"flip{size_mib}")
    b = backend_of(st)
    name = "ns/m/f-1-0/5"
    t = ints(size_mib * 256, 1024, seed=5)
    await st.put_many([(name, t)])
    raw = bytearray(await _raw_get(env, b.options.key(name)))
    raw[-1000] ^= 0x10  # in the last range of the large object
    await _raw_put(env, b.options.key(name), bytes(raw))
    handed: list[torch.Tensor] = []

    def alloc(header):
        handed.append(torch.empty(header.shape, dtype=torch.int32))
        return handed[-1]

    assert await st.get_many([name], out=[alloc]) == [None], "unverified bytes are never handed back"
    assert st.tiers[0].counters.corrupt == 1
    assert await st.contains_many([name]) == [False]
    await st.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_corrupt_read_leaves_a_copy_written_after_it(env, streamed):
    """A read that finds an object corrupt quarantines only the copy it read: a good one
    another process put after that read (a rewrite, a repair) stays and serves the next
    read, whether the corrupt one was read whole or streamed into the caller's tensor."""
    st = store(env.endpoint, f"rewrite-{streamed}")
    b = backend_of(st)
    name = "ns/m/f-1-0/6"
    t = ints(256, 1024, seed=7)
    await st.put_many([(name, t)])
    key = b.options.key(name)
    good = await _raw_get(env, key)
    raw = bytearray(good)
    raw[-1000] ^= 0x10
    await _raw_put(env, key, bytes(raw))
    method = "read_streamed" if streamed else "get_many"
    read = getattr(b, method)

    async def read_then_another_process_rewrites(*args, **kw):  # type: ignore[no-untyped-def]
        got = await read(*args, **kw)
        await _raw_put(env, key, good)
        return got

    setattr(b, method, read_then_another_process_rewrites)
    tier = st.tiers[0]
    out = [torch.zeros_like(t)] if streamed else None
    assert await tier.get_many([name], out=out) == [None]
    setattr(b, method, read)
    assert tier.counters.corrupt == 1 and b.counters.quarantined == 0
    (got,) = await tier.get_many([name], out=[torch.zeros_like(t)] if streamed else None)
    assert got is not None and torch.equal(got, t)
    await st.close()


async def test_a_frame_stored_under_another_name_is_refused(env):
    st = store(env.endpoint, "misplaced")
    b = backend_of(st)
    t = ints(64, 1024, seed=6)
    await st.put_many([("ns/m/f-1-0/a", t)])
    await _raw_put(env, b.options.key("ns/m/f-1-0/b"), await _raw_get(env, b.options.key("ns/m/f-1-0/a")))
    out = torch.zeros_like(t)
    assert await st.get_many(["ns/m/f-1-0/b"], out=[out]) == [None]
    assert not torch.equal(out, t) or st.tiers[0].counters.corrupt == 1
    await st.close()


async def test_streamed_puts_are_retried_and_counted(env, proxy):
    st = store(proxy.url, "putfault", max_attempts=2, breaker_failures=100)
    b = backend_of(st)
    t = ints(256, 1024, seed=11)
    proxy.inject(Fault.SLOWDOWN)
    proxy.inject(Fault.RESET)
    assert await st.put_many([("ns/m/f-1-0/w", t)]) == [True]  # sent again, whole
    assert proxy.injected == {"slowdown": 1, "reset": 1}
    out = torch.zeros_like(t)
    assert (await st.get_many(["ns/m/f-1-0/w"], out=[out]))[0] is out and torch.equal(out, t)
    proxy.set_mode(Fault.ERROR_500)
    assert await st.put_many([("ns/m/f-1-0/x", t)]) == [False]
    assert b.counters.put_errors == 1 and b.stats().extra["errors"]["server_error"] == 1
    proxy.set_mode(None)
    await st.close()


async def test_stream_false_reads_through_aiobotocore(env):
    st = store(env.endpoint, "plain", stream="false")
    b = backend_of(st)
    assert not b.capabilities.streamed_reads
    t = ints(256, 1024, seed=7)
    await st.put_many([("ns/m/f-1-0/p", t)])
    out = torch.zeros_like(t)
    assert (await st.get_many(["ns/m/f-1-0/p"], out=[out]))[0] is out and torch.equal(out, t)
    assert b._streams is None
    await st.close()
    with pytest.raises(ValueError, match="stream"):
        store(env.endpoint, "bad", stream="perhaps")


async def test_a_proxy_in_the_environment_turns_streaming_off(env, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "")
    st = store(env.endpoint, "proxied")
    assert not backend_of(st).capabilities.streamed_reads
    await st.close()


async def test_an_endpoint_from_the_environment_behind_a_proxy_is_reached_through_it(env, server, monkeypatch):
    """An endpoint botocore takes from ``AWS_ENDPOINT_URL`` and reaches only through the
    site's proxy: streaming (which speaks HTTP itself, without proxies) turns off, so
    puts and reads go through the proxy too."""
    with FaultProxy(("127.0.0.1", server.ports.s3)) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.internal.invalid:8333")
        monkeypatch.setenv("HTTP_PROXY", relay.url)
        monkeypatch.setenv("NO_PROXY", "")
        monkeypatch.delenv("no_proxy", raising=False)
        b = S3Backend(f"s3://{BUCKET}/env-endpoint-{os.getpid()}?region=us-east-1&addressing_style=path&connect_timeout=0.5&read_timeout=2")
        assert not b.capabilities.streamed_reads
        await b.open()
        assert await b.put_many([("ns/m/f-1-0/e", b"x" * 1000)]) == [True]
        assert await b.contains_many(["ns/m/f-1-0/e"]) == [True]
        await b.close()


@pytest.fixture
def proxy(server):
    with FaultProxy(("127.0.0.1", server.ports.s3)) as p:
        yield p


async def test_slowdown_5xx_and_resets_before_the_body_are_retried(env, proxy):
    st = store(proxy.url, "retry")
    t = ints(512, 1024, seed=8)
    await st.put_many([("ns/m/f-1-0/r", t)])
    again = backend_of(st)._stream_pool()[0].retries
    proxy.inject(Fault.SLOWDOWN, count=2)
    proxy.inject(Fault.ERROR_500)
    proxy.inject(Fault.RESET)
    out = torch.zeros_like(t)
    assert (await st.get_many(["ns/m/f-1-0/r"], out=[out]))[0] is out and torch.equal(out, t)
    assert proxy.injected == {"slowdown": 2, "error_500": 1, "reset": 1}
    b = backend_of(st)
    assert b.counters.get_errors == 0 and b._streams is not None and b._streams.retries - again == 4
    await st.close()


async def test_persistent_throttling_is_a_counted_miss(env, proxy):
    st = store(proxy.url, "throttle", max_attempts=2, breaker_failures=100)
    t = ints(64, 1024, seed=9)
    await st.put_many([("ns/m/f-1-0/t", t)])
    proxy.set_mode(Fault.SLOWDOWN)
    assert await st.get_many(["ns/m/f-1-0/t"], out=[torch.zeros_like(t)]) == [None]
    b = backend_of(st)
    assert b.stats().extra["errors"]["throttled"] == 1 and b.counters.get_errors == 1
    assert proxy.injected["slowdown"] == 2  # two attempts
    proxy.set_mode(None)
    await st.close()


async def test_a_stalled_server_meets_the_deadline(env, proxy):
    st = store(proxy.url, "stall", timeout=1.5, read_timeout=0.5, max_attempts=2)
    t = ints(64, 1024, seed=10)
    await st.put_many([("ns/m/f-1-0/s", t)])
    proxy.set_mode(Fault.STALL)
    t0 = time.monotonic()
    assert await st.get_many(["ns/m/f-1-0/s"], out=[torch.zeros_like(t)]) == [None]
    assert time.monotonic() - t0 < 2.5
    errors = backend_of(st).stats().extra["errors"]
    assert errors.get("timeout") == 1
    proxy.set_mode(None)
    await st.close()


async def test_a_cancelled_read_returns_only_after_the_writes_into_out_end(env, server):
    with FaultProxy(("127.0.0.1", server.ports.s3), rate=10 * MiB) as slow:  # 10 MiB/s per connection
        st = store(slow.url, "cancel")
        names = [f"ns/m/f-1-0/c{i}" for i in range(3)]
        ts = [ints(2048, 1024, seed=20 + i) for i in range(3)]  # 8 MiB each: ~0.8 s at that rate
        await st.put_many(list(zip(names, ts)))
        outs = [torch.zeros_like(t) for t in ts]
        reader = asyncio.ensure_future(st.get_many(names, out=outs))
        await asyncio.sleep(0.1)
        reader.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert time.monotonic() - t0 < 0.3, "the transfers were stopped, not run to their end (~0.7 s more)"
        seen = [o.clone() for o in outs]
        await asyncio.sleep(0.4)
        assert all(torch.equal(o, s) for o, s in zip(outs, seen)), "a worker wrote into `out` after cancel"
        assert not all(torch.equal(o, t) for o, t in zip(outs, ts))
        b = backend_of(st)
        assert b.counters.get_errors == 0 and "timeout" not in b.stats().extra["errors"]
        out = torch.zeros_like(ts[0])  # the backend reads on, on new connections
        assert (await st.get_many(names[:1], out=[out]))[0] is out and torch.equal(out, ts[0])
        await st.close()


async def test_a_server_trickling_bytes_meets_the_deadline(env, server):
    with FaultProxy(("127.0.0.1", server.ports.s3), rate=200 << 10) as slow:  # 200 KiB/s, never silent
        st = store(slow.url, "trickle", timeout=1.0, read_timeout=5)
        t = ints(1024, 1024, seed=30)  # 4 MiB: 20 s at that rate
        await st.put_many([("ns/m/f-1-0/slow", t)])
        t0 = time.monotonic()
        assert await st.get_many(["ns/m/f-1-0/slow"], out=[torch.zeros_like(t)]) == [None]
        assert time.monotonic() - t0 < 2.0
        b = backend_of(st)
        assert b.stats().extra["errors"]["timeout"] == 1 and b.counters.get_errors == 1
        await st.close()


async def test_an_empty_object_leaves_its_connection_usable(env):
    st = store(env.endpoint, "empty", max_attempts=1, concurrency=1)
    b = backend_of(st)
    t = ints(64, 64, seed=31)
    await st.put_many([("ns/m/f-1-0/e", t), ("ns/m/f-1-0/f", t)])
    await _raw_put(env, b.options.key("ns/m/f-1-0/e"), b"")  # e.g. a truncated upload elsewhere
    assert await st.get_many(["ns/m/f-1-0/e"], out=[torch.zeros_like(t)]) == [None]
    out = torch.zeros_like(t)
    assert (await st.get_many(["ns/m/f-1-0/f"], out=[out]))[0] is out and torch.equal(out, t)
    assert b.counters.get_errors == 0
    await st.close()


async def test_an_object_over_max_object_size_is_a_miss_never_placed(env):
    st = store(env.endpoint, "huge", max_object_size="1MiB")
    b = backend_of(st)
    t = ints(64, 1024, seed=32)  # 256 KiB: stored
    await st.put_many([("ns/m/f-1-0/h", t)])
    await _raw_put(env, b.options.key("ns/m/f-1-0/h"), b"x" * (2 << 20))  # grown past the limit
    placed: list[object] = []

    def out(header):  # type: ignore[no-untyped-def]
        placed.append(header)
        return torch.empty(header.shape, dtype=torch.int32)

    assert await st.get_many(["ns/m/f-1-0/h"], out=[out]) == [None]
    assert placed == [] and b.counters.rejected == 1
    await st.close()


def test_botocore_checksums_or_a_proxy_keep_everything_on_aiobotocore(monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    base = "s3://b/p?endpoint_url=http://127.0.0.1:9"
    assert S3Backend(base).capabilities.streamed_reads
    assert not S3Backend(base + "&checksum=when_supported").capabilities.streamed_reads
    assert not S3Backend(base + "&stream=false").capabilities.streamed_reads
