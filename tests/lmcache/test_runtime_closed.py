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
