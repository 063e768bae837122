"""Redis faults: refused, kill -9 mid-batch, restart, hang.  Nothing may escape the backend.

Puts fail as counted False, gets become counted misses (None), no wrong bytes are ever
returned, every batch ends by its deadline, and the same backend object works again
once the server is back.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvstore.backends import open_backend
from kvstore.testing.redis_server import RedisServer, free_port
from tests.redis.conftest import FAST

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # an unawaited coroutine is a bug
MiB = 1 << 20


def items(tag: str, n: int, size: int) -> list[tuple[str, bytes]]:
    return [(f"ns/m/vllm-1-0/{tag}{i}", os.urandom(size)) for i in range(n)]


async def test_connection_refused_is_counted_and_quick():
    b = open_backend(f"redis://127.0.0.1:{free_port()}/0?{FAST}")
    t0 = time.monotonic()
    assert await b.put_many(items("r", 3, 1000)) == [False] * 3
    assert await b.get_many(["ns/m/vllm-1-0/r0", "ns/m/vllm-1-0/r1"]) == [None, None]
    assert await b.contains_many(["ns/m/vllm-1-0/r0"]) == [False]
    assert await b.delete_many(["ns/m/vllm-1-0/r0"]) == [False]
    assert [i async for i in b.list()] == []
    assert time.monotonic() - t0 < 3
    c = b.stats().counters
    assert (c.put_errors, c.get_errors, c.misses, c.hits) == (3, 2 + 1, 2, 0)  # + the failed listing
    await b.close()


async def test_kill_during_batch_then_restart_same_backend(redis_server):
    b = open_backend(f"{redis_server.url}?{FAST}")
    small = items("s", 20, 64 * 1024)
    big = items("b", 12, 8 * MiB)
    assert all(await b.put_many(small + big))
    expected = dict(small + big)

    async def kill_soon() -> None:
        await asyncio.sleep(0.01)
        redis_server.kill()

    fresh = items("n", 24, 8 * MiB)  # ~200 MiB in flight: still moving when the kill lands
    killer = asyncio.create_task(kill_soon())
    t0 = time.monotonic()
    puts, gets = await asyncio.gather(b.put_many(fresh), b.get_many(list(expected)))
    await killer
    assert time.monotonic() - t0 < 5
    assert not all(puts), "the kill should have failed some puts"
    for name, got in zip(expected, gets):
        assert got is None or bytes(got) == expected[name]  # a miss, never wrong bytes
    assert b.counters.put_errors >= 1

    # while down: quick failures, nothing raised
    assert await b.put_many(fresh[:2]) == [False, False]
    assert await b.get_many([fresh[0][0], fresh[1][0]]) == [None, None]

    redis_server.start()  # same port, empty (no persistence)
    assert await b.put_many(fresh) == [True] * len(fresh)
    got = await b.get_many([n for n, _ in fresh])
    assert [bytes(g) for g in got] == [v for _, v in fresh]
    await b.close()


async def test_restart_between_batches_reconnects_without_new_backend(redis_server):
    b = open_backend(f"{redis_server.url}?{FAST}")
    assert await b.put("ns/m/f-1-0/x", b"before")
    redis_server.restart()
    # pooled connections are dead; the first call after the restart must still work
    assert await b.get("ns/m/f-1-0/x") is None  # the restarted server is empty: a plain miss
    assert await b.put("ns/m/f-1-0/x", b"after")
    assert bytes(await b.get("ns/m/f-1-0/x")) == b"after"
    assert b.counters.get_errors == 0 and b.counters.put_errors == 0
    await b.close()


async def test_hung_server_hits_the_deadline_then_recovers():
    with RedisServer() as srv:
        b = open_backend(f"{srv.url}?timeout=0.5&connect_timeout=0.5")
        assert await b.put("ns/m/f-1-0/x", b"v")
        srv.pause()  # SIGSTOP: accepts nothing, answers nothing
        try:
            t0 = time.monotonic()
            puts, gets = await asyncio.gather(
                b.put_many(items("h", 4, 2 * MiB)), b.get_many(["ns/m/f-1-0/x", "ns/m/f-1-0/y"])
            )
            elapsed = time.monotonic() - t0
        finally:
            srv.resume()
        assert puts == [False] * 4 and gets == [None, None]
        assert elapsed < 2.5, f"a hung server held the batch for {elapsed:.1f}s"
        assert bytes(await b.get("ns/m/f-1-0/x")) == b"v"
        await b.close()


async def test_multi_part_overwrite_cut_off_reads_old_or_new_never_a_mix():
    with RedisServer() as srv:
        b = open_backend(f"{srv.url}?part_size=1MiB&timeout=0.3&connect_timeout=0.5")
        name = "ns/m/f-1-0/multi"
        first, second = os.urandom(24 * MiB), os.urandom(24 * MiB)
        assert await b.put(name, first)

        async def hang_soon() -> None:
            await asyncio.sleep(0.01)
            srv.pause()

        hanger = asyncio.create_task(hang_soon())
        try:
            ok = await b.put(name, second)  # cut off by the deadline part-way through
        finally:
            await hanger
            srv.resume()
        got = await b.get(name)
        assert got is not None
        # A put cut off by its deadline may still land: the server runs the manifest SET it
        # had already received once it runs again, so False means "not known to be stored".
        # What must never be read is a mix of the two values. (Booleans, not a comparison
        # of the bytes: pytest would diff 24 MiB.)
        is_old, is_new = bytes(got) == first, bytes(got) == second
        assert is_old or is_new, "a read returned neither the old value nor the new one"
        assert is_new or not ok, "a put said stored, but the old value is read"
        await b.close()


async def test_eviction_under_maxmemory_gives_misses_never_partial_data():
    """allkeys-random eviction drops manifests and parts independently: whole hits or misses."""
    with RedisServer(extra=["--maxmemory", "12mb", "--maxmemory-policy", "allkeys-random"]) as srv:
        b = open_backend(f"{srv.url}?part_size=256KiB&{FAST}")
        values = {f"ns/m/f-1-0/e{i}": os.urandom(700 * 1024 + i) for i in range(40)}  # 3 parts each
        for name, value in values.items():  # ~28 MiB into 12 MiB: most get evicted
            await b.put(name, value)
        got = await b.get_many(list(values))
        hits = [g for g in got if g is not None]
        assert 0 < len(hits) < len(values)
        for value, g in zip(values.values(), got):
            assert g is None or bytes(g) == value
        await b.close()
