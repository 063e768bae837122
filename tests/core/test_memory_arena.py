"""The memory tier's arena: objects of a bounded tier live in one reused mapping, and a
region is never handed out again while a reader still views the object it held."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.backends import open_backend
from kvstore.backends.base import BackendUnavailableError
from kvstore.backends.memory import MemoryBackend
from kvstore.backends.memory_arena import ARENA_MIN, PAGE, Arena

MiB = 1 << 20


def test_regions_are_page_aligned_and_freed_extents_merge() -> None:
    arena = Arena(8 * MiB)
    a, b, c = (arena.alloc(2 * MiB + 1) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert [r.offset % PAGE for r in (a, b, c)] == [0, 0, 0]
    assert arena.alloc(4 * MiB) is None  # 3 x (2 MiB + a page) taken: less than 2 MiB left
    arena.free(a)
    arena.free(b)  # a and b merge into one extent long enough for 4 MiB
    big = arena.alloc(4 * MiB)
    assert big is not None and big.offset == 0
    assert arena.alloc(9 * MiB) is None


def test_a_viewed_region_is_not_reused_until_its_last_view_goes() -> None:
    arena = Arena(2 * MiB)
    region = arena.alloc(2 * MiB)
    assert region is not None
    with region.view(2 * MiB) as w:
        w[:] = b"\x07" * (2 * MiB)
    held = np.frombuffer(region.view(2 * MiB)[MiB:], dtype=np.uint8)  # a derived buffer
    arena.free(region)
    del region
    assert arena.alloc(MiB) is None  # still viewed: retired, not free
    assert arena.retired_bytes == 2 * MiB
    assert held.min() == held.max() == 7
    del held
    again = arena.alloc(2 * MiB)
    assert again is not None and arena.retired_bytes == 0


async def test_a_full_tier_reuses_its_arena_and_keeps_bytes_equal() -> None:
    size = 4 * MiB
    tier = MemoryBackend.from_url(f"mem://?capacity={4 * size}")
    objects = {f"k{i}": bytes([i]) * size for i in range(12)}
    for name, data in objects.items():
        assert await tier.put_many([(name, data)]) == [True]
    arena = tier._space.arena
    assert arena is not None and arena.taken == 4 * size  # evicted objects' regions reused
    extra = tier.stats().extra
    assert extra["arena_taken_bytes"] == 4 * size and extra["arena_retired_bytes"] == 0
    assert extra["preallocated"] is False
    names = [f"k{i}" for i in range(8, 12)]
    got = await tier.get_many(names)
    assert [bytes(v) if v is not None else None for v in got] == [objects[n] for n in names]
    assert (await tier.get_many(["k0"])) == [None]


async def test_a_view_handed_out_survives_eviction_of_its_object() -> None:
    size = 2 * MiB
    tier = MemoryBackend.from_url(f"mem://?capacity={2 * size}")
    await tier.put_many([("a", b"\x01" * size), ("b", b"\x02" * size)])
    (view,) = await tier.get_many(["a"])
    assert view is not None and view.readonly
    tensor = torch.frombuffer(view, dtype=torch.uint8)  # a reader keeps only the tensor
    del view
    for i in range(6):  # evicts "a", then fills the tier over and over
        assert await tier.put_many([(f"n{i}", bytes([0x10 + i]) * size)]) == [True]
    assert (await tier.get_many(["a"])) == [None]
    assert int(tensor.min()) == int(tensor.max()) == 1  # the reader's bytes are untouched
    got = await tier.get_many(["n4", "n5"])
    assert [bytes(v) if v is not None else None for v in got] == [b"\x14" * size, b"\x15" * size]


async def test_small_objects_and_unbounded_tiers_need_no_arena() -> None:
    unbounded = MemoryBackend.from_url("mem://")
    assert unbounded._space.arena is None
    await unbounded.put_many([("x", b"y" * ARENA_MIN)])
    assert [bytes(v) if v is not None else None for v in await unbounded.get_many(["x"])] == [
        b"y" * ARENA_MIN
    ]
    tier = MemoryBackend.from_url("mem://?capacity=8MiB")
    await tier.put_many([("small", b"s" * 100)])
    assert tier._space.arena is not None and tier._space.arena.taken == 0
    assert [bytes(v) if v is not None else None for v in await tier.get_many(["small"])] == [b"s" * 100]


async def test_preallocate_option() -> None:
    tier = open_backend("mem://?capacity=8MiB&preallocate=true")
    await tier.put_many([("k", b"\x05" * (3 * MiB))])
    (got,) = await tier.get_many(["k"])
    assert got is not None and bytes(got) == b"\x05" * (3 * MiB)
    with pytest.raises(ValueError, match="needs a capacity"):
        open_backend("mem://?preallocate=true")
    with pytest.raises(ValueError, match="preallocate"):
        open_backend("mem://?capacity=8MiB&preallocate=maybe")


async def test_a_capacity_beyond_memory_is_a_bound_unless_preallocated() -> None:
    # 64 TiB: more than any test machine's MemAvailable, so refused before anything is touched
    huge = open_backend("mem://?capacity=64TiB")  # address space only: pages come as used
    await huge.put_many([("k", b"\x06" * MiB)])
    assert [bytes(v) if v is not None else None for v in await huge.get_many(["k"])] == [b"\x06" * MiB]
    with pytest.raises(BackendUnavailableError, match="lower capacity or drop preallocate=true"):
        open_backend("mem://?capacity=64TiB&preallocate=true")


def test_stores_on_two_threads_sharing_a_named_tier_never_read_each_others_bytes() -> None:
    import asyncio
    import sys
    import threading

    size = ARENA_MIN + 100
    wrong: list[str] = []
    errors: list[BaseException] = []

    async def work(t: int) -> None:
        tier = MemoryBackend.from_url(f"mem://race-shared?capacity={6 * size}")
        for i in range(150):
            name = f"t{t}-{i % 9}"
            await tier.put_many([(name, bytes([t * 16 + i % 9]) * size)])
            for got_name, got in zip([name], await tier.get_many([name])):
                if got is not None and bytes(got[:1]) != bytes([t * 16 + i % 9]):
                    wrong.append(got_name)

    def run(t: int) -> None:
        try:
            asyncio.run(work(t))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(before)
    assert errors == [] and wrong == []


async def test_objects_that_fill_the_capacity_exactly_all_fit_in_the_arena() -> None:
    from kvstore.backends.memory_arena import Region

    size = 4 * MiB + 100  # a frame: never a whole number of pages
    tier = MemoryBackend.from_url(f"mem://?capacity={8 * size}")
    for i in range(16):
        assert await tier.put_many([(f"k{i}", bytes([i]) * size)]) == [True]
    kept = tier._space.objects
    assert len(kept) == 8 and all(isinstance(o.data, Region) for o in kept.values())


# ------------------------------------------------------- large copies off the event loop


async def test_large_objects_are_copied_off_the_loop_and_appear_whole(monkeypatch) -> None:
    """A 4 MiB put copies on a worker thread: meanwhile the loop serves other calls, and
    a reader never sees the object until all of its bytes are in."""
    import asyncio
    import threading

    from kvstore.backends import memory

    backend = MemoryBackend.from_url("mem://?capacity=64MiB")
    payload = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes()
    small = b"s" * 1000
    started, release = threading.Event(), threading.Event()
    threads: dict[str, int] = {}
    real_fill = memory._Pending.fill

    def fill(self) -> None:  # type: ignore[no-untyped-def]
        threads[self.name] = threading.get_ident()
        if self.name == "t/big":
            started.set()
            assert release.wait(10)
        real_fill(self)

    monkeypatch.setattr(memory._Pending, "fill", fill)
    put = asyncio.ensure_future(backend.put_many([("t/big", payload), ("t/small", small)]))
    assert await asyncio.to_thread(started.wait, 10)
    # the loop is free while the big copy runs, and the half-copied object is invisible
    assert await backend.contains_many(["t/big"]) == [False]
    assert (await backend.get_many(["t/big"]))[0] is None
    release.set()
    assert await put == [True, True]
    assert threads["t/small"] == threading.get_ident() != threads["t/big"]
    got = (await backend.get_many(["t/big"]))[0]
    assert got is not None and bytes(got) == payload
    assert backend.stats().bytes == len(payload) + len(small)


async def test_a_failed_copy_is_a_failed_put_and_gives_its_room_back(monkeypatch) -> None:
    from kvstore.backends import memory

    backend = MemoryBackend.from_url("mem://?capacity=16MiB")
    real_fill = memory._Pending.fill

    def fill(self) -> None:  # type: ignore[no-untyped-def]
        if self.name == "t/bad":
            raise MemoryError("simulated")
        real_fill(self)

    monkeypatch.setattr(memory._Pending, "fill", fill)
    good = b"g" * (2 * MiB)
    assert await backend.put_many([("t/bad", b"b" * (2 * MiB)), ("t/good", good)]) == [False, True]
    assert backend.stats().bytes == len(good) and backend.stats().objects == 1
    assert (await backend.get_many(["t/bad"]))[0] is None
    # the failed object's region went back: the tier still holds its full capacity
    monkeypatch.setattr(memory._Pending, "fill", real_fill)
    names = [f"t/fill{i}" for i in range(7)]
    assert all(await backend.put_many([(n, b"x" * (2 * MiB)) for n in names]))
    assert backend.stats().extra["arena_taken_bytes"] <= backend.stats().extra["arena_bytes"]
    assert backend.stats().bytes == 8 * 2 * MiB


async def test_closing_a_private_tier_while_it_copies_fails_that_put(monkeypatch) -> None:
    import asyncio
    import threading

    from kvstore.backends import memory

    backend = MemoryBackend.from_url("mem://?capacity=16MiB")
    started, release = threading.Event(), threading.Event()
    real_fill = memory._Pending.fill

    def fill(self) -> None:  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        real_fill(self)  # the region's view keeps its pages mapped: no fault after close

    monkeypatch.setattr(memory._Pending, "fill", fill)
    put = asyncio.ensure_future(backend.put_many([("t/big", b"z" * (4 * MiB))]))
    assert await asyncio.to_thread(started.wait, 10)
    await backend.close()
    release.set()
    assert await put == [False]
    assert backend.stats().objects == 0 and backend.stats().bytes == 0


async def test_a_put_whose_caller_stops_waiting_still_lands_whole(monkeypatch) -> None:
    """A deadline cancels the caller, not the copy: the object is published when its
    bytes are in, and its room is accounted for either way."""
    import asyncio
    import threading

    from kvstore.backends import memory

    backend = MemoryBackend.from_url("mem://?capacity=16MiB")
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB
    started, release = threading.Event(), threading.Event()
    real_fill = memory._Pending.fill

    def fill(self) -> None:  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        real_fill(self)

    monkeypatch.setattr(memory._Pending, "fill", fill)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(backend.put_many([("t/late", payload)]), 0.2)
    assert started.is_set() and (await backend.get_many(["t/late"]))[0] is None
    release.set()
    for _ in range(200):
        got = (await backend.get_many(["t/late"]))[0]
        if got is not None:
            break
        await asyncio.sleep(0.01)
    assert got is not None and bytes(got) == payload
    assert backend.stats().bytes == len(payload) and backend.stats().objects == 1
