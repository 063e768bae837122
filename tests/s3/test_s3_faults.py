"""The S3 backend under faults: throttling, 5xx, resets, stalls, a killed and restarted server.

Faults come from a real loopback proxy between client and SeaweedFS (tests/support/
fault_proxy.py), or from killing the server process group itself.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from kvstore.backends import open_backend
from kvstore.frame import encode_frame
from kvstore.testing.fault_proxy import Fault, FaultProxy
from kvstore.testing.seaweed import SeaweedS3, weed_binary
from tests.support.required import SEAWEED_INSTALL, require

BUCKET = "kvstore-faults"
FAST = {"connect_timeout": 0.5, "read_timeout": 1, "breaker_reset": 0.3}


@pytest.fixture(scope="module")
def server():
    require(weed_binary() is not None, "SeaweedFS (weed)", SEAWEED_INSTALL)
    with SeaweedS3() as s:
        s.create_bucket(BUCKET)
        yield s


@pytest.fixture
def env(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server


@pytest.fixture
def proxy(server):
    with FaultProxy(("127.0.0.1", server.ports.s3)) as p:
        yield p


def proxied_url(proxy, prefix: str, **options) -> str:
    from urllib.parse import urlencode

    return f"s3://{BUCKET}/{prefix}?" + urlencode(
        {"endpoint_url": proxy.url, "region": "us-east-1", **FAST, **options}
    )


async def test_slowdown_5xx_and_resets_are_retried_by_botocore(env, proxy):
    async with open_backend(proxied_url(proxy, "retry")) as b:
        data = os.urandom(100_000)
        proxy.inject(Fault.SLOWDOWN, count=2)
        assert await b.put("x/1", data)
        proxy.inject(Fault.ERROR_500)
        proxy.inject(Fault.RESET)
        assert bytes(await b.get("x/1")) == data
        assert proxy.injected == {"slowdown": 2, "error_500": 1, "reset": 1}
        assert b.counters.put_errors == b.counters.get_errors == 0


async def test_concurrency_is_bounded_and_parts_and_ranges_run_in_parallel(env, server):
    # 50 ms per answer, so requests that may overlap do overlap
    with FaultProxy(("127.0.0.1", server.ports.s3), latency=0.05) as slow:
        async with open_backend(proxied_url(slow, "par", concurrency=3)) as b:
            assert all(await b.put_many([(f"p/{i}", b"x" * 100) for i in range(12)]))
            assert await b.get_many([f"p/{i}" for i in range(12)]) == [memoryview(b"x" * 100)] * 12
            assert slow.peak_active == 3  # never more than `concurrency`
        # (deadlines well past 0.4 s an answer: what is tested here is overlap, and a
        # loaded machine once let one part's answer run past the 1 s read timeout)
        async with open_backend(proxied_url(slow, "par", read_timeout=10, timeout=60)) as b:
            big = os.urandom(40 << 20)  # five 8 MiB parts / ranges
            # 0.4 s per answer: parts issued while hashing the next one on a busy 2-core
            # machine still overlap (at 50 ms a CI run once saw only 3 of 5 at once, and
            # at 0.2 s once more, with other jobs on the machine)
            slow.latency = 0.4
            slow.peak_active = 0
            assert await b.put("p/big", big)
            assert slow.peak_active >= 4
            slow.peak_active = 0
            assert bytes(await b.get("p/big")) == big
            assert slow.peak_active >= 4


async def test_persistent_throttling_becomes_counted_false_and_none(env, proxy):
    async with open_backend(proxied_url(proxy, "throttle", max_attempts=2, breaker_failures=100)) as b:
        proxy.set_mode(Fault.SLOWDOWN)
        assert await b.put_many([(f"t/{i}", b"v") for i in range(3)]) == [False] * 3
        assert await b.get_many(["t/0", "t/1"]) == [None, None]
        assert await b.contains_many(["t/0"]) == [False]
        errors = b.stats().extra["errors"]
        # a HEAD answer has no body, so its 503 cannot say SlowDown: a plain server error
        assert (errors["throttled"], errors["server_error"]) == (5, 1)
        assert (b.counters.put_errors, b.counters.get_errors, b.counters.misses) == (3, 2, 2)
        assert proxy.injected["slowdown"] == 2 * 6  # two attempts each: botocore retried, we did not


async def test_stalled_server_hits_the_deadline_not_a_hang(env, proxy):
    async with open_backend(proxied_url(proxy, "stall", timeout=1.5, read_timeout=5)) as b:
        assert await b.put("s/1", b"x")
        proxy.set_mode(Fault.STALL)
        t0 = time.monotonic()
        assert await b.get_many(["s/1", "s/2", "s/3"]) == [None] * 3
        assert time.monotonic() - t0 < 2.5
        assert b.stats().extra["errors"]["timeout"] == 3
        proxy.set_mode(None)


async def test_breaker_opens_stops_calling_and_half_opens_to_recover(env, proxy):
    async with open_backend(proxied_url(proxy, "breaker", max_attempts=2, breaker_failures=3)) as b:
        assert await b.put("b/1", b"one")
        proxy.set_mode(Fault.ERROR_500)
        assert await b.get_many(["b/1"] * 3) == [None] * 3
        assert b.breaker.state.value == "open"
        sent = proxy.requests
        assert await b.get_many(["b/1"] * 5) == [None] * 5
        assert proxy.requests == sent  # refused without touching the server
        assert b.stats().extra["errors"]["breaker_open"] == 5
        proxy.set_mode(None)
        await asyncio.sleep(0.35)
        assert await b.get("b/1") == memoryview(b"one")  # the probe succeeds
        assert b.breaker.state.value == "closed"
        assert await b.get_many(["b/1"] * 4) == [memoryview(b"one")] * 4


@pytest.mark.parametrize("stream", ["false", "true"])
async def test_objects_changed_under_reads_are_misses_that_do_not_open_the_breaker(env, proxy, stream):
    """A 412 (an object rewritten between a read's first GET and its ranges, which ask
    for the first one's ETag) is the server answering correctly: a counted miss, and the
    breaker stays closed for the reads that follow."""
    url = proxied_url(proxy, f"changed-{stream}", stream=stream, max_attempts=2, breaker_failures=3)
    async with open_backend(url) as b:
        assert await b.put("c/1", b"one")
        proxy.inject(Fault.PRECONDITION, count=5)
        assert await b.get_many(["c/1"] * 5) == [None] * 5
        assert b.stats().extra["errors"]["changed"] == 5
        assert b.breaker.state.value == "closed"
        assert await b.get("c/1") == memoryview(b"one")  # served at once: no breaker to wait out


@pytest.mark.parametrize("stream", ["false", "true"])
async def test_reads_their_callers_cancel_do_not_open_the_breaker(env, server, stream):
    """A caller that stops waiting (a tier deadline, an aborted request) says nothing
    about the server: cancelled reads of a healthy server leave the breaker closed and
    the next read is served."""
    from kvstore.tier import Tier

    with FaultProxy(("127.0.0.1", server.ports.s3), latency=0.5) as slow:
        async with Tier(open_backend(proxied_url(slow, f"cancel-{stream}", stream=stream, breaker_failures=3))) as tier:
            t = torch.arange(1024, dtype=torch.float32)
            assert await tier.put_many([("c/m/f-1-0/1", t)]) == [True]
            for _ in range(5):
                reading = asyncio.ensure_future(tier.get_many(["c/m/f-1-0/1"], out=[torch.zeros_like(t)]))
                await asyncio.sleep(0.1)
                reading.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await reading
            assert tier.backend.breaker.state.value == "closed"
            (got,) = await tier.get_many(["c/m/f-1-0/1"], out=[torch.zeros_like(t)])
            assert got is not None and torch.equal(got, t)


async def test_server_killed_mid_batch_then_restarted_backend_recovers(env, server):
    url = server.url(BUCKET, "crash", concurrency=2, max_attempts=2, timeout=3, **FAST)
    b = open_backend(url)
    await b.open()
    blobs = {f"c/{i}": os.urandom(2 << 20) for i in range(24)}
    assert all(await b.put_many(list(blobs.items())))

    allocs = 0

    def alloc_then_kill(size: int) -> memoryview:
        nonlocal allocs
        allocs += 1
        if allocs == 3:  # the third object's answer has begun: kill the server mid-batch
            server.kill()
        return memoryview(bytearray(size))

    t0 = time.monotonic()
    got = await b.get_many(list(blobs), alloc=alloc_then_kill)  # must not raise
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 2
    failed = sum(g is None for g in got)
    # at most two objects were done and two in flight (concurrency=2) when it died
    assert failed >= len(blobs) - 4 and b.counters.get_errors == failed and b.counters.misses == failed
    assert all(bytes(g) == blobs[n] for n, g in zip(blobs, got) if g is not None)  # no torn data
    assert await b.put_many([("c/new", b"n")]) == [False]
    assert await b.contains_many(["c/0"]) == [False]

    server.restart()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if await b.put("c/new", b"n") and await b.get("c/new") == memoryview(b"n"):
            break
        await asyncio.sleep(0.2)
    assert await b.get("c/new") == memoryview(b"n")  # the same backend object, no reopen
    assert bytes(await b.get("c/5")) == blobs["c/5"]
    assert b.breaker.state.value == "closed"
    await b.close()


async def test_gc_never_counts_a_failed_delete_as_done(env, proxy):
    """The server answers 500 from the delete on: the delete's own existence check
    failed, so nothing was deleted, then gc's lookup answered "not there" and the objects
    were reported deleted. A failed delete is counted and gc reports them not deleted."""
    from kvstore.ops.inspect import gc_store

    async with open_backend(proxied_url(proxy, "gc-fault", max_attempts=2, breaker_failures=100)) as b:
        names = [f"g/{i}" for i in range(3)]
        frames = [encode_frame([os.urandom(64)], codec="raw", shape=(64,), key=n) for n in names]
        assert all(await b.put_many(list(zip(names, frames))))
        real_delete = b.delete_many

        async def fail_then_delete(ns):  # type: ignore[no-untyped-def]
            proxy.set_mode(Fault.ERROR_500)
            return await real_delete(ns)

        b.delete_many = fail_then_delete  # type: ignore[method-assign]
        report = await gc_store(b, older_than_s=0)
        proxy.set_mode(None)
        assert report.deleted == [] and sorted(report.not_deleted) == names
        assert b.counters.delete_errors == 3
        assert await b.contains_many(names) == [True] * 3


def test_a_listing_that_fails_after_the_open_check_is_exit_3_with_the_fix(env, proxy, monkeypatch):
    """The bucket answers the open check, then its listing fails: the command ended in a
    traceback with exit 1. Now it says what to do and exits 3, as for any backend that
    cannot be used."""
    from click.testing import CliRunner

    from kvstore.backends.s3 import S3Backend
    from kvstore.cli.main import cli

    url = proxied_url(proxy, "list-fault", max_attempts=2)
    real_check = S3Backend.check

    async def check_then_fail(self):  # type: ignore[no-untyped-def]
        await real_check(self)
        proxy.set_mode(Fault.ERROR_500)

    monkeypatch.setattr(S3Backend, "check", check_then_fail)
    for args in (["ls", url], ["gc", url, "--older-than", "1d"]):
        res = CliRunner().invoke(cli, args)
        proxy.set_mode(None)
        assert res.exit_code == 3 and isinstance(res.exception, SystemExit), res.output
        assert "failed part way" in res.output and "check that the endpoint answers" in res.output
        assert "Traceback" not in res.output
