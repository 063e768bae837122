"""The plugin's store runtime once it is closed: whatever still arrives (a put LMCache
hands over while shutting down, a read, a lookup) ends at once as a miss or a failed
write, its memory objects released, and no coroutine is left unawaited."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from kvstore.store_config import StoreConfig
from kvstore_lmcache.runtime import StoreRuntime


def test_a_closed_runtime_refuses_work_and_releases_what_it_was_given() -> None:
    rt = StoreRuntime(StoreConfig.from_mapping({"kvstore.tiers": "mem://closed-rt"}), name="kvstore-plugin")
    rt.close()
    released: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut, chosen = rt.start_put(
            [("a/b/c-1-0/1", torch.ones(16), 64), ("a/b/c-1-0/2", torch.ones(16), 64)],
            lambda idx: rt.store.put_many([]),
            released.append,
        )
        assert chosen == [0, 1] and fut is not None
        assert fut.result(timeout=5) == [False, False]
        assert released == [0, 1]
        assert rt.pending_bytes == 0 and rt.inflight("a/b/c-1-0/1") is None
        assert rt.call(rt.store.contains_many(["a/b/c-1-0/1"]), [False], "lookup") == [False]
        with pytest.raises(RuntimeError, match="closed"):
            rt.submit(rt.store.contains_many(["a/b/c-1-0/1"]))
        gc.collect()
    assert rt.counters.put_failed == 2 and rt.counters.errors == 1
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.skipif(not hasattr(__import__("asyncio").Task, "cancelling"), reason="needs Task.cancelling (3.11+)")
def test_a_read_the_closing_runtime_cancels_is_a_miss_on_the_callers_loop() -> None:
    """A read awaited on LMCache's loop (`acall`) whose store task the closing runtime
    cancels returns the miss; the cancellation does not reach LMCache's coroutine."""
    import asyncio
    import threading

    rt = StoreRuntime(
        StoreConfig.from_mapping({"kvstore.tiers": "mem://closing-rt", "kvstore.timeout_s": 60}),
        name="kvstore-plugin",
    )
    started = threading.Event()

    async def stuck() -> list[bool]:
        started.set()
        await asyncio.Event().wait()
        return [True]

    async def caller() -> list[bool]:
        return await rt.acall(stuck(), [False], "read")

    closer = threading.Thread(target=lambda: (started.wait(10), rt.close()))
    closer.start()
    assert asyncio.run(asyncio.wait_for(caller(), 30)) == [False]
    closer.join(30)
    assert rt.counters.errors == 1


def test_close_from_a_callback_on_the_loop_does_not_block_it() -> None:
    """A done-callback runs on the store's loop thread; a close called there is handed to
    a thread of its own instead of waiting on the loop it runs on."""
    import threading
    import time

    rt = StoreRuntime(StoreConfig.from_mapping({"kvstore.tiers": "mem://close-cb"}), name="kvstore-plugin")
    returned = threading.Event()

    def on_done(_f) -> None:
        rt.close()
        returned.set()

    async def nothing() -> None:
        return None

    rt.submit(nothing()).add_done_callback(on_done)
    assert returned.wait(5)
    deadline = time.monotonic() + 30
    while not rt._close_done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt._close_done.is_set() and not rt._thread.is_alive()


def test_two_closes_at_once_both_return_after_the_close() -> None:
    import threading

    rt = StoreRuntime(StoreConfig.from_mapping({"kvstore.tiers": "mem://close-twice"}), name="kvstore-plugin")
    closers = [threading.Thread(target=rt.close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
        assert not t.is_alive()
    assert rt._close_done.is_set() and not rt._thread.is_alive() and rt.loop.is_closed()


def test_a_closing_plugin_finds_nothing() -> None:
    """Once close began (here: waiting for a write to end), lookups answer 0: the reads
    that would follow are refused, so a hit would be a miss LMCache did not plan for."""
    import asyncio
    import threading
    import time

    from lmcache.utils import CacheEngineKey

    from kvstore_lmcache.bridge import InProcessBridge

    rt = StoreRuntime(StoreConfig.from_mapping({"kvstore.tiers": "mem://close-lookup"}), name="kvstore-plugin")
    bridge = InProcessBridge(rt, None, count_inflight=True)
    key = CacheEngineKey("m", 1, 0, 12345, torch.bfloat16)
    name = bridge.names([key])[0]
    assert rt.submit(rt.store.put_many([(name, torch.ones(64, dtype=torch.uint8))])).result(10) == [True]
    assert bridge.lookup([key]) == 1
    release = threading.Event()

    async def slow_write() -> None:
        while not release.is_set():
            await asyncio.sleep(0.01)

    rt.submit(slow_write(), "write")
    closer = threading.Thread(target=rt.close)
    closer.start()
    deadline = time.monotonic() + 10
    while not rt.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert rt.closed and closer.is_alive()  # closing: waiting for the write
    assert bridge.lookup([key]) == 0
    release.set()
    closer.join(30)
    assert not closer.is_alive()
