"""TieredStore on real memory and disk tiers: bytes, placement, in-flight rules, tenants, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from kvstore.backends.memory import MemoryBackend
from kvstore.frame import UnsealedFrame
from kvstore.namespaces import NamespaceRule
from kvstore.tier import Tier
from kvstore.tiered import TieredStore, TierSpec
from tests.support.stores import FakeClock, GatedMemoryBackend, HeldMemoryBackend

N = 64  # float32 elements per chunk


class FailingMemoryBackend(MemoryBackend):
    """A memory backend whose reads fail as a backend answers a failed read (a counted
    error, the object absent): for the names in `failing`, or for every name while
    `away`."""

    failing: frozenset[str] = frozenset()
    away = False

    async def get_many(self, names, alloc=None):  # type: ignore[no-untyped-def]
        if self.away:
            self.counters.get_errors += len(names)
            return [None] * len(names)
        got = await super().get_many(names, alloc)
        for k, n in enumerate(names):
            if n in self.failing:
                self.counters.get_errors += 1
                got[k] = None
        return got


def name(i: int, ns: str = "t") -> str:
    return f"{ns}/m/raw-1-0/{i:06d}"


def chunk(i: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + i


async def failing_store(*chunks: int) -> tuple[FailingMemoryBackend, TieredStore, list[str]]:
    """One tier over a `FailingMemoryBackend` holding chunks `chunks`; the names it
    announces gone are collected in the list returned."""
    backend = FailingMemoryBackend("mem://")
    store = TieredStore([TierSpec(Tier(backend), capacity=1 << 20)])
    gone: list[str] = []
    store.on_gone = gone.extend
    await store.put_many([(name(i), chunk(i)) for i in chunks])
    return backend, store, gone



async def frame_size() -> int:
    store = TieredStore.from_urls(["mem://"])
    await store.put_many([(name(0), chunk(0))])
    size = store.placement.tiers[0].used
    await store.close()
    return size


async def backend_names(tier: Tier) -> set[str]:
    return {info.name async for info in tier.backend.list("")}


async def test_round_trip_prefix_lookup_contains_and_delete() -> None:
    async with TieredStore.from_urls(["mem://", "mem://"]) as store:
        ok = await store.put_many([(name(i), chunk(i)) for i in range(5)], chained=True)
        assert ok == [True] * 5
        got = await store.get_many([name(i) for i in range(6)])
        for i in range(5):
            assert torch.equal(got[i], chunk(i))
        assert got[5] is None
        out = [torch.empty(N) for _ in range(2)]
        got = await store.get_many([name(1), name(2)], out=out)
        assert got[0].data_ptr() == out[0].data_ptr() and torch.equal(out[1], chunk(2))
        assert await store.prefix_lookup([name(0), name(1), name(9), name(2)]) == 2
        assert await store.contains_many([name(4), name(9)]) == [True, False]
        assert await store.delete_many([name(4), name(9)]) == [True, False]
        assert await store.contains_many([name(4)]) == [False]
        assert await backend_names(store.tiers[0]) == {name(i) for i in range(4)}


async def test_victims_are_demoted_and_read_back_then_promoted_on_hit() -> None:
    size = await frame_size()
    async with TieredStore.from_urls(
        [f"mem://?capacity={3 * size}", f"mem://?capacity={100 * size}"]
    ) as store:
        await store.put_many([(name(i), chunk(i)) for i in range(8)])
        await store.drain()
        hot, warm = store.placement.tiers
        assert hot.used <= 3 * size and len(hot.resident) == 3
        assert len(warm.resident) == 5
        assert await backend_names(store.tiers[0]) == set(hot.resident)
        assert await backend_names(store.tiers[1]) == set(warm.resident)
        cold = sorted(warm.resident)[0]
        (t,) = await store.get_many([cold])
        assert torch.equal(t, chunk(int(cold[-6:])))
        await store.drain()
        assert cold in hot.resident and cold in warm.resident  # promoted, lower copy kept
        assert await backend_names(store.tiers[0]) == set(hot.resident)
        text = store.metrics.text()
        assert 'kvstore_moves_total{kind="demote",tier="tier1"}' in text
        assert 'kvstore_moves_total{kind="promote",tier="tier0"}' in text


async def test_a_demotion_in_flight_is_still_readable_from_its_old_tier() -> None:
    size = await frame_size()
    warm = GatedMemoryBackend()
    store = TieredStore(
        [
            TierSpec(Tier(MemoryBackend("mem://")), capacity=2 * size, policy="lru"),
            TierSpec(Tier(warm), capacity=50 * size, policy="lru"),
        ]
    )
    await store.put_many([(name(i), chunk(i)) for i in range(2)])
    warm.gate.clear()
    await store.put_many([(name(2), chunk(2))])  # evicts name(0) into the (blocked) warm tier
    for _ in range(10):
        await asyncio.sleep(0)
    assert store.placement.where(name(0)) == 1 and warm.waiting == 1
    (t,) = await store.get_many([name(0)])  # read from the hot tier, where its bytes still are
    assert torch.equal(t, chunk(0))
    assert warm.counters.gets == 0
    warm.gate.set()
    await store.drain()
    for tier, state in zip(store.tiers, store.placement.tiers):
        assert await backend_names(tier) == set(state.resident)
    got = await store.get_many([name(i) for i in range(3)])
    assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
    await store.close()


async def test_a_write_is_invisible_until_it_lands_and_is_not_evicted_meanwhile() -> None:
    size = await frame_size()
    gated = GatedMemoryBackend()
    store = TieredStore([TierSpec(Tier(gated), capacity=2 * size, policy="lru")])
    await store.put_many([(name(0), chunk(0))])
    gated.gate.clear()
    writing = asyncio.ensure_future(store.put_many([(name(1), chunk(1))]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert gated.waiting == 1
    assert await store.contains_many([name(1)]) == [False]
    assert await store.prefix_lookup([name(0), name(1)]) == 1
    assert await store.get_many([name(1)]) == [None]
    gated.gate.set()
    assert await writing == [True]
    assert await store.contains_many([name(1)]) == [True]
    await store.close()


async def test_known_prefix_answers_from_the_books_and_leaves_unknown_names_to_the_tiers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What another thread may ask without the store's loop: held names yes, a name being
    written no, a name no tier has no, and None (ask on the loop) where a tier has a name
    the books do not know (stored by another process: discovery adopts it)."""
    url = f"file://{tmp_path / 'd'}?fsync=false"
    size = await frame_size()
    gated = GatedMemoryBackend()
    store = TieredStore([TierSpec(Tier(gated), capacity=4 * size, policy="lru")], discover=True)
    await store.put_many([(name(0), chunk(0)), (name(1), chunk(1))])
    assert store.known_prefix([name(0), name(1)]) == 2
    assert store.known_prefix([name(0), name(7), name(1)]) == 1  # the memory tier says at once: no name(7)
    assert await store.prefix_lookup([name(0), name(7), name(1)]) == 1
    gated.gate.clear()
    writing = asyncio.ensure_future(store.put_many([(name(2), chunk(2))]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert store.known_prefix([name(0), name(1), name(2), name(3)]) == 2  # not yet landed: not served
    gated.gate.set()
    assert await writing == [True]
    assert store.known_prefix([name(0), name(1), name(2)]) == 3
    await store.close()

    async with TieredStore.from_urls([url], discover=True) as first:
        assert await first.put_many([(name(i), chunk(i)) for i in range(3)]) == [True] * 3
    async with TieredStore.from_urls([url], discover=True) as later:  # a later process on the same files
        assert later.known_prefix([name(5)]) in (None, 0)  # None while its index opens
        await later.tiers[0].backend.ready()  # type: ignore[attr-defined]
        from kvstore.backends.disk import local_file_system

        assert later.known_prefix([name(5)]) == (0 if local_file_system(tmp_path) else None)  # the disk says at once it has no such file
        assert later.known_prefix([name(0), name(1)]) is None  # it has: found and adopted on the loop
        assert await later.prefix_lookup([name(0), name(1), name(2), name(3)]) == 3
    async with TieredStore.from_urls([url]) as blind:  # without discovery the books are the answer
        assert blind.known_prefix([name(0)]) == 0


async def test_lookup_now_answers_each_name_pins_what_it_found_and_defers_to_the_loop() -> None:
    """`lookup_now` on another thread: per name, held or not, with the held names pinned
    so the loop's next eviction passes them over; None (ask on the loop) while the loop
    is changing the books or where a tier holds a name the books do not know."""
    size = await frame_size()
    store = TieredStore(
        [TierSpec(Tier(MemoryBackend("mem://")), capacity=3 * size, policy="lru")], discover=True
    )
    await store.put_many([(name(0), chunk(0)), (name(1), chunk(1))])
    found = await asyncio.to_thread(store.lookup_now, [name(0), name(7), name(1)], 60)
    assert found == [True, False, True]
    assert store.stats().pinned == 2
    for i in range(2, 8):  # pressure: only name(0) and name(1) are pinned, the rest make room
        await store.put_many([(name(i), chunk(i))])
    assert await store.contains_many([name(0), name(1)]) == [True, True]
    assert await asyncio.to_thread(store.lookup_now, [name(2)], 60) == [False]  # evicted meanwhile
    with store.parts.changing():  # the loop is in the middle of a decision
        assert await asyncio.to_thread(store.lookup_now, [name(0)], 60) is None
    store.unpin([name(0), name(1)])
    assert store.stats().pinned == 0
    most = store.parts.tiers[0].backend.contains_now_most()  # names a tier answers at once
    many = [name(100 + i) for i in range(most)]  # a long prompt's miss: asked in batches
    assert await asyncio.to_thread(store.lookup_now, many, 60) == [False] * len(many)
    assert await asyncio.to_thread(store.lookup_now, [*many, name(99)], 60) is None  # longer: the loop asks
    other = MemoryBackend("mem://")
    shared = TieredStore([TierSpec(Tier(other))], discover=True)
    await Tier(other).put_many([(name(9), chunk(9))])  # written past the books: another process's
    assert await asyncio.to_thread(shared.lookup_now, [name(9)], 60) is None  # the loop adopts it
    assert await shared.contains_many([name(9)]) == [True]
    got = await shared.get_many([name(9)])  # a read adopts it into the books
    assert got[0] is not None and torch.equal(got[0], chunk(9))
    assert await asyncio.to_thread(shared.lookup_now, [name(9)], 60) == [True]
    await shared.close()
    await store.close()


async def test_a_name_being_evicted_is_not_found_again_while_its_delete_runs() -> None:
    """With discovery, a name the engine just evicted is out of the books while its bytes
    are still being deleted: it must not be promised (and pinned) again meanwhile, on the
    loop or on another thread, only to be gone when it is read."""
    size = await frame_size()
    held = HeldMemoryBackend()
    store = TieredStore([TierSpec(Tier(held), capacity=2 * size, policy="lru")], discover=True)
    await store.put_many([(name(0), chunk(0)), (name(1), chunk(1))])
    held.deletes.clear()  # the eviction's delete is held
    put = asyncio.ensure_future(store.put_many([(name(2), chunk(2))]))  # evicts name(0)
    await asyncio.sleep(0.05)
    assert name(0) in held._space.objects  # (its bytes are still there)
    assert await store.contains_many([name(0), name(1)]) == [False, True]
    assert await asyncio.to_thread(store.lookup_now, [name(0)], 60) == [False]
    assert store.stats().pinned == 0
    held.deletes.set()
    assert await put == [True]
    assert await store.contains_many([name(0), name(2)]) == [False, True]
    await store.close()


async def test_pinned_chunks_survive_pressure_until_unpinned_or_expired() -> None:
    size = await frame_size()
    clock = FakeClock()
    store = TieredStore(
        [TierSpec(Tier(MemoryBackend("mem://")), capacity=3 * size, policy="lru")], clock=clock
    )
    await store.put_many([(name(0), chunk(0))])
    store.pin([name(0)], ttl=10)
    for i in range(1, 10):
        await store.put_many([(name(i), chunk(i))])
    assert await store.contains_many([name(0)]) == [True]
    assert store.stats().pinned == 1
    clock.advance(11)  # the pin has expired
    for i in range(10, 13):
        await store.put_many([(name(i), chunk(i))])
    assert await store.contains_many([name(0)]) == [False]
    await store.put_many([(name(0), chunk(0))])
    store.pin([name(0)])
    store.unpin([name(0)])
    for i in range(13, 16):
        await store.put_many([(name(i), chunk(i))])
    assert await store.contains_many([name(0)]) == [False]
    await store.close()


async def test_known_prefix_promises_nothing_held_only_by_a_tier_that_is_failing() -> None:
    """A tier whose breaker is open serves nothing: a lookup on another thread counts a
    chunk only where an answering tier below holds a copy."""
    size = await frame_size()
    store = TieredStore([TierSpec(Tier(MemoryBackend()), capacity=2 * size), TierSpec(Tier(MemoryBackend()))])
    await store.put_many([(name(i), chunk(i)) for i in range(4)])
    top = [i for i in range(4) if store.placement.where(name(i)) == 0]
    assert top and store.known_prefix([name(i) for i in range(4)]) == 4
    breaker = store.breakers[0]
    for _ in range(breaker.failure_threshold):
        assert breaker.allow()
        breaker.record(False)
    assert breaker.refusing()
    copies = [i for i in top if name(i) in store.placement.tiers[1].resident]
    for i in top:
        assert store.known_prefix([name(i)]) == (1 if i in copies else 0)
    assert store.known_prefix([name(i) for i in range(4)]) == min(
        [i for i in top if i not in copies], default=4
    )
    await store.close()


async def test_namespace_quota_drops_the_tenants_oldest_and_ttl_expires() -> None:
    size = await frame_size()
    clock = FakeClock()
    store = TieredStore.from_urls(
        ["mem://"],
        namespaces={"a": NamespaceRule(quota=3 * size), "b": NamespaceRule(ttl=60)},
        clock=clock,
    )
    await store.put_many([(name(i, "b"), chunk(i)) for i in range(2)])
    await store.put_many([(name(i, "a"), chunk(i)) for i in range(3)])
    await store.put_many([(name(i, "a"), chunk(i)) for i in range(3, 5)])
    assert await store.contains_many([name(i, "a") for i in range(5)]) == [False, False, True, True, True]
    assert store.stats().namespaces["a"] == {"bytes": 3 * size, "objects": 3}
    clock.advance(30)
    assert await store.contains_many([name(0, "b")]) == [True]
    assert store.known_prefix([name(0, "b"), name(1, "b")]) == 2  # a lookup on another thread too
    clock.advance(31)
    assert store.known_prefix([name(0, "b")]) == 0  # past its TTL: not promised, even before it is dropped
    assert store.known_prefix([name(2, "a")]) == 1  # no TTL for this tenant
    assert await store.get_many([name(0, "b")]) == [None]
    assert store.stats().namespaces["b"]["objects"] == 0
    assert await backend_names(store.tiers[0]) == {name(i, "a") for i in (2, 3, 4)}
    text = store.metrics.text()
    assert 'kvstore_quota_evictions_total{namespace="a"} 2.0' in text
    assert 'kvstore_expired_total{namespace="b"} 2.0' in text
    await store.close()


@pytest.mark.parametrize("policy", ["chain", "lru", "reuse"])
async def test_a_write_into_a_full_tier_keeps_its_own_chunks_while_older_ones_can_go(policy: str) -> None:
    """A store batch landing in a full tier is stored whole while older chunks can make
    room, and a batch larger than the tier keeps its first chunks (its later ones are
    refused): a batch never pushes out its own chunks.  Before, a full `chain` tier at a
    cold start failed two of every four writes (it ranked each new chunk below the one
    before it), and the MP adapter reported the store task failed."""

    def big(i: int) -> torch.Tensor:
        return torch.full((1024,), float(i))

    store = TieredStore.from_urls([f"mem://?capacity={10 * (4096 + 200)}&policy={policy}"])
    for r in range(12):
        batch = [name(r * 4 + i) for i in range(4)]
        assert await store.put_many([(n, big(r * 4 + i)) for i, n in enumerate(batch)]) == [True] * 4, f"batch {r}"
        assert all(n in store.placement.tiers[0].resident for n in batch)
    got = await store.get_many(batch)
    assert all(g is not None and torch.equal(g, big(44 + i)) for i, g in enumerate(got))
    st = store.stats().tiers[0]
    assert st.objects == 10 and st.writes == 48 and st.evictions == 38
    await store.close()

    size = await frame_size()
    small = TieredStore([TierSpec(Tier(MemoryBackend()), capacity=3 * size, policy=policy)])
    assert await small.put_many([(name(100 + i), chunk(i)) for i in range(5)], chained=True) == [True] * 3 + [False] * 2
    assert await small.prefix_lookup([name(100 + i) for i in range(5)]) == 3
    await small.close()

    quota = TieredStore.from_urls(["mem://"], namespaces={"a": NamespaceRule(quota=3 * size)})
    assert await quota.put_many([(name(i, "a"), chunk(i)) for i in range(5)]) == [True] * 3 + [False] * 2
    assert await quota.contains_many([name(i, "a") for i in range(5)]) == [True] * 3 + [False] * 2
    await quota.close()

    # a continuation (`parent=`) does not push the prefix it continues out of the quota either
    quota = TieredStore.from_urls(["mem://"], namespaces={"a": NamespaceRule(quota=4 * size)})
    n = [name(i, "a") for i in range(5)]
    assert await quota.put_many([(n[i], chunk(i)) for i in range(2)], chained=True) == [True] * 2
    got = await quota.put_many([(n[i], chunk(i)) for i in range(2, 5)], chained=True, parent=n[1])
    assert got == [True, True, False]
    assert await quota.prefix_lookup(n) == 4
    await quota.close()


@pytest.mark.parametrize("policy", ["chain", "lru", "reuse"])
async def test_a_batch_larger_than_the_hot_tier_goes_on_below_it_and_is_never_lost(policy: str) -> None:
    """Two small tiers and a chained batch larger than both: the chunks the hot tier cannot
    take land in the tier below, the rest are refused, and everything reported stored is
    held as one prefix — including a chunk the batch only touched (held from before)."""
    size = await frame_size()

    def two_tiers(top: int, below: int) -> TieredStore:
        return TieredStore(
            [
                TierSpec(Tier(MemoryBackend()), capacity=top * size, policy=policy),
                TierSpec(Tier(MemoryBackend()), capacity=below * size, policy=policy),
            ]
        )

    store = two_tiers(2, 2)
    names = [name(i) for i in range(6)]
    assert await store.put_many([(n, chunk(i)) for i, n in enumerate(names)], chained=True) == [True] * 4 + [False] * 2
    assert await store.prefix_lookup(names) == 4
    got = await store.get_many(names[:4])
    assert all(g is not None and torch.equal(g, chunk(i)) for i, g in enumerate(got))
    await store.close()

    store = two_tiers(3, 1)
    x = name(99)
    assert await store.put_many([(x, chunk(99))]) == [True]
    items = [(name(0), chunk(0)), (name(1), chunk(1)), (x, chunk(99))] + [(name(i), chunk(i)) for i in range(2, 5)]
    ok = await store.put_many(items, chained=True)
    assert ok == [True] * 4 + [False] * 2
    assert await store.contains_many([n for n, _ in items]) == ok
    await store.close()


@pytest.mark.parametrize("policy", ["chain", "lru", "reuse"])
async def test_a_concurrent_write_does_not_push_out_another_writes_chunks_before_they_land(policy: str) -> None:
    """Two store tasks of fresh unchained chunks (MP-mode keys) into a tier with room for
    only part of both: the second makes room with older, landed chunks, not with the
    first's chunks still on their way to the medium, so both tasks succeed.  (Before,
    `chain` at a cold start ranked the first task's chunks lowest: that task failed.)"""
    size = await frame_size()
    backend = GatedMemoryBackend()
    store = TieredStore([TierSpec(Tier(backend), capacity=8 * size, policy=policy)])
    for i in range(4):
        assert await store.put_many([(name(i), chunk(i))]) == [True]
    backend.gate.clear()
    first = asyncio.ensure_future(store.put_many([(name(10 + i), chunk(10 + i)) for i in range(2)]))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(store.put_many([(name(20 + i), chunk(20 + i)) for i in range(4)]))
    await asyncio.sleep(0.01)
    backend.gate.set()
    assert await first == [True, True]
    assert await second == [True] * 4
    got = await store.get_many([name(10), name(11)] + [name(20 + i) for i in range(4)])
    assert all(g is not None for g in got)
    await store.close()


async def test_a_slow_write_through_tier_does_not_hold_landed_chunks_in_the_fast_one() -> None:
    """A batch landed in the memory tier while its write-through copy is still on its
    way: a second batch can make room with it there (protection lasts until a chunk has
    landed somewhere, not until every tier has it)."""
    size = await frame_size()
    slow = GatedMemoryBackend()
    store = TieredStore(
        [
            TierSpec(Tier(MemoryBackend("mem://")), capacity=8 * size, policy="lru"),
            TierSpec(Tier(slow), capacity=1000 * size, policy="lru", write="through"),
        ]
    )
    slow.gate.clear()
    first = asyncio.ensure_future(store.put_many([(name(i), chunk(i)) for i in range(8)]))
    await asyncio.sleep(0.02)
    second = asyncio.ensure_future(store.put_many([(name(100 + i), chunk(i)) for i in range(4)]))
    await asyncio.sleep(0.02)
    assert all(name(100 + i) in store.placement.tiers[0].resident for i in range(4))
    slow.gate.set()
    assert await first == [True] * 8 and await second == [True] * 4
    await store.close()


async def test_a_put_cancelled_while_its_evictions_run_leaves_nothing_behind() -> None:
    """The caller gives up on a put while the deletes that make its room are slow: its
    names do not stay invisible or protected, and the tier takes later writes."""
    size = await frame_size()
    backend = HeldMemoryBackend()
    store = TieredStore([TierSpec(Tier(backend), capacity=4 * size, policy="lru")])
    for i in range(4):
        await store.put_many([(name(i), chunk(i))])
    backend.deletes.clear()
    put = asyncio.ensure_future(store.put_many([(name(10), chunk(10)), (name(11), chunk(11))]))
    await asyncio.sleep(0.02)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    backend.deletes.set()
    assert not store.inflight.writing(name(10)) and name(10) not in store.inflight
    assert await store.put_many([(name(20 + i), chunk(i)) for i in range(4)]) == [True] * 4
    await store.close()


async def _books_match(store: TieredStore, backend: MemoryBackend) -> bool:
    await store.drain()
    return set(store.placement.tiers[0].resident) == {info.name async for info in backend.list("")}


async def test_a_delete_decided_before_a_name_is_stored_again_does_not_land_on_the_new_bytes() -> None:
    """delete_many(X) whose backend delete is slow, then put_many(X) again: the old delete
    must not remove the new object (the books would promise X and every read miss)."""
    backend = HeldMemoryBackend()
    store = TieredStore([TierSpec(Tier(backend), capacity=1 << 20)])
    await store.put_many([(name(1), chunk(1))])
    backend.deletes.clear()
    deleting = asyncio.ensure_future(store.delete_many([name(1)]))
    await asyncio.sleep(0.01)
    writing = asyncio.ensure_future(store.put_many([(name(1), chunk(2))]))
    await asyncio.sleep(0.01)
    backend.deletes.set()
    await deleting
    assert await writing == [True]
    assert await _books_match(store, backend)
    got = await store.get_many([name(1)])
    assert got[0] is not None and torch.equal(got[0], chunk(2))
    await store.close()


async def test_a_slow_delete_from_every_tier_still_lands_before_the_name_is_written_again() -> None:
    """Two tiers (the second write-through), deletes that take nearly the tier deadline:
    a put of the deleted name waits for the deletes in both tiers (they run at once, not
    one tier after the other), so both media keep the new object."""

    class SlowDeletes(MemoryBackend):
        slow = False

        async def delete_many(self, names: Sequence[str]) -> list[bool]:
            if self.slow:
                await asyncio.sleep(0.15)
            return await super().delete_many(names)

    backends = [SlowDeletes("mem://"), SlowDeletes("mem://")]
    store = TieredStore(
        [
            TierSpec(Tier(backends[0]), capacity=1 << 20),
            TierSpec(Tier(backends[1]), capacity=1 << 20, write="through"),
        ],
        tier_timeout=0.25,  # one tier's delete fits it, two in a row do not
    )
    assert await store.put_many([(name(1), chunk(1))]) == [True]
    for b in backends:
        b.slow = True
    deleting = asyncio.ensure_future(store.delete_many([name(1)]))
    await asyncio.sleep(0.01)
    assert await store.put_many([(name(1), chunk(2))]) == [True]
    await deleting
    await store.drain()
    for j, b in enumerate(backends):
        assert name(1) in store.placement.tiers[j].resident
        assert {info.name async for info in b.list("")} == {name(1)}, f"tier {j} lost the new object"
    await store.close()


async def test_a_read_that_found_the_old_object_gone_keeps_the_new_one() -> None:
    """A read finds X gone (deleted meanwhile), and X is stored again before the read
    answers: the read's "gone" is about the old object; the new one stays in the books."""
    backend = HeldMemoryBackend()
    store = TieredStore([TierSpec(Tier(backend), capacity=1 << 20)])
    await store.put_many([(name(1), chunk(1))])
    backend.reads_in.clear()
    backend.reads_out.clear()
    reading = asyncio.ensure_future(store.get_many([name(1)]))
    await asyncio.sleep(0.01)
    await store.delete_many([name(1)])
    backend.reads_in.set()
    await asyncio.sleep(0.01)
    assert await store.put_many([(name(1), chunk(2))]) == [True]
    backend.reads_out.set()
    await reading
    assert await _books_match(store, backend)
    got = await store.get_many([name(1)])
    assert got[0] is not None and torch.equal(got[0], chunk(2))
    await store.close()


@pytest.mark.parametrize("url", ["mem://", "mem://?capacity=64MiB"])
async def test_a_corrupt_chunk_is_a_counted_quarantined_miss(url: str) -> None:
    backend = MemoryBackend.from_url(url)
    store = TieredStore([TierSpec(Tier(backend))])
    await store.put_many([(name(0), torch.arange(1 << 17, dtype=torch.float32))])  # 512 KiB: in the arena
    (raw,) = await backend.get_many([name(0)])
    assert raw is not None
    data = bytes(raw)
    del raw
    await backend.put_many([(name(0), data[:-1] + bytes([data[-1] ^ 0xFF]))])  # flip a payload byte
    assert await store.get_many([name(0)]) == [None]
    assert await store.contains_many([name(0)]) == [False]
    text = store.metrics.text()
    assert 'kvstore_quarantines_total{tier="tier0"} 1.0' in text
    assert 'kvstore_misses_total{namespace="t"} 1.0' in text
    await store.close()


async def test_metrics_are_per_store_and_per_tier_and_namespace() -> None:
    a = TieredStore.from_urls(["mem://"])
    b = TieredStore.from_urls(["mem://"])
    await a.put_many([(name(0, "x"), chunk(0))])
    await a.get_many([name(0, "x"), name(1, "x")])
    text = a.metrics.text()
    assert 'kvstore_hits_total{namespace="x",tier="tier0"} 1.0' in text
    assert 'kvstore_misses_total{namespace="x"} 1.0' in text
    assert 'kvstore_op_seconds_count{op="get",tier="tier0"} 1.0' in text
    assert "kvstore_bytes_in_total" in text and "kvstore_tier_bytes" in text
    assert 'namespace="x"' not in b.metrics.text()
    await a.close()
    await b.close()


def test_from_urls_reads_store_options_and_capacity_is_the_mediums(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = TieredStore.from_urls(
        [
            "mem://?capacity=1MiB&policy=lru&high=0.9&low=0.7",
            f"file://{tmp_path}?capacity=10MiB&write=through&fsync=false",
        ]
    )
    hot, warm = store.placement.tiers
    assert (hot.capacity, hot.policy.name, hot.high, hot.low) == (1 << 20, "lru", 0.9, 0.7)
    assert (warm.capacity, warm.policy.name, warm.write) == (10 << 20, "chain", "through")
    # capacity is the medium's: the backends enforce it too (the hard bound), the rest stays out
    assert (store.tiers[0].backend.capacity, store.tiers[1].backend.capacity) == (1 << 20, 10 << 20)
    assert store.specs[1].tier.backend.url == f"file://{tmp_path}?capacity=10MiB&fsync=false"
    with pytest.raises(ValueError, match="write=back or write=through"):
        TieredStore.from_urls(["mem://?write=sideways"])
    with pytest.raises(ValueError, match="must be more than zero"):
        TieredStore.from_urls(["mem://?capacity=0"])
    with pytest.raises(ValueError, match="is unknown"):
        TieredStore.from_urls(["mem://?policy=fifo"])
    with pytest.raises(ValueError, match="belady"):
        TieredStore.from_urls(["mem://?policy=belady"])


async def test_no_pass_over_a_large_chunk_runs_on_the_event_loop() -> None:
    """Framing a large contiguous tensor reads none of its bytes (on the loop, no hop);
    its checksum, and the framing of a large tensor that must be copied, run on worker
    threads; a small chunk is framed and sealed at once, on the loop."""
    import threading

    store = TieredStore.from_urls(["mem://"])
    top = store.tiers[0]
    framed_on: list[tuple[str, bool]] = []
    plain = top.encode
    sealed_on: list[str] = []
    seal = UnsealedFrame.ensure_sealed

    def encode(tensor: torch.Tensor, name: str, layout: str = "raw", **kw: Any) -> list[memoryview]:
        framed_on.append((threading.current_thread().name, tensor.is_contiguous()))
        return plain(tensor, name, layout, **kw)

    def ensure_sealed(frame: UnsealedFrame) -> None:
        sealed_on.append(threading.current_thread().name)
        seal(frame)

    top.encode = encode  # type: ignore[method-assign]
    big = [torch.arange(1 << 19, dtype=torch.float32) + i for i in range(3)]  # 2 MiB each
    strided = (torch.arange(1 << 20, dtype=torch.float32) + 7)[::2]  # 2 MiB, not contiguous
    small = torch.arange(16, dtype=torch.float32)
    items = [(name(i), t) for i, t in enumerate(big)] + [(name(8), strided), (name(9), small)]
    with mock.patch.object(UnsealedFrame, "ensure_sealed", ensure_sealed):
        assert await store.put_many(items) == [True] * 5
    loop_thread = threading.current_thread().name
    strided_on = [on for on, contiguous in framed_on if not contiguous]
    assert len(strided_on) == 1 and strided_on[0] != loop_thread  # copied off the loop
    assert sum(on == loop_thread for on, _ in framed_on) == 4  # three in place, and the small one
    assert len(sealed_on) == 4 and loop_thread not in sealed_on  # every large one's checksum: off it
    got = await store.get_many([n for n, _ in items])
    assert all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items))
    await store.close()


@pytest.mark.parametrize("disk_first", [True, False])
async def test_large_chunks_written_to_a_disk_and_a_memory_tier_at_once_read_back_from_both(
    tmp_path: Path, disk_first: bool
) -> None:
    """A large frame leaves the writer unsealed; one written into two tiers (write-through)
    is sealed before either write starts, so neither tier waits on the other's write, and
    both hold the same valid frame."""
    from kvstore.backends.disk import DiskBackend

    disk = TierSpec(Tier(DiskBackend(tmp_path, fsync=False)), capacity=1 << 30, policy="lru")
    mem = TierSpec(Tier(MemoryBackend("mem://")), capacity=1 << 30, policy="lru")
    top, below = (disk, mem) if disk_first else (mem, disk)
    below.write = "through"
    store = TieredStore([top, below])
    big = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(6)]  # 4 MiB
    items = [(name(i), t) for i, t in enumerate(big)]
    arrived: list[bool] = []  # whether each frame reached a tier's put_frames sealed
    put_frames = Tier.put_frames

    async def recording(tier: Tier, batch: Sequence[tuple[str, Sequence[memoryview]]]) -> list[bool]:
        arrived.extend(not isinstance(f, UnsealedFrame) or f.sealed for _, f in batch)
        return await put_frames(tier, batch)

    with mock.patch.object(Tier, "put_frames", recording):
        assert await store.put_many(items) == [True] * 6
    assert arrived == [True] * 12  # sealed before either write started
    for tier in store.tiers:
        frames = await tier.get_frames([n for n, _ in items])
        assert all(f is not None and bytes(f.payload) == t.numpy().tobytes() for f, (_, t) in zip(frames, items))
    got = await store.get_many([n for n, _ in items])
    assert all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items))
    await store.close()


class _FailingMemory(MemoryBackend):
    async def put_many(self, items):  # type: ignore[no-untyped-def]
        return [False] * len(items)


async def test_known_prefix_never_sees_the_middle_of_a_write_being_planned_or_failing() -> None:
    """A reader on another thread may be switched in between any two steps of the loop:
    placed-but-not-yet-marked-as-writing and unmarked-but-not-yet-forgotten are not
    states a lookup may answer "held" from."""
    store = TieredStore.from_urls(["mem://"])
    seen: list[int | None] = []
    real_add = store.inflight.add_write

    def add_write(ticket, key):  # type: ignore[no-untyped-def]
        seen.append(store.known_prefix([key]))  # placed by the engine, not yet marked
        real_add(ticket, key)

    store.inflight.add_write = add_write  # type: ignore[method-assign]
    assert await store.put_many([(name(1), chunk(1))]) == [True]
    assert seen == [None] and store.known_prefix([name(1)]) == 1
    await store.close()

    failing = TieredStore([TierSpec(Tier(_FailingMemory("mem://")), capacity=1 << 20, policy="lru")])
    real_wrote = failing.inflight.wrote

    def wrote(ticket, key):  # type: ignore[no-untyped-def]
        real_wrote(ticket, key)
        seen.append(failing.known_prefix([key]))  # no longer marked, not yet forgotten

    failing.inflight.wrote = wrote  # type: ignore[method-assign]
    assert await failing.put_many([(name(2), chunk(2))]) == [False]
    assert seen[1:] == [None] and failing.known_prefix([name(2)]) == 0
    await failing.close()


async def test_known_prefix_on_another_thread_never_promises_a_chunk_whose_write_failed() -> None:
    import sys
    import threading

    store = TieredStore([TierSpec(Tier(_FailingMemory("mem://")), capacity=1 << 30, policy="lru")])
    asked = [name(0)]
    stop = threading.Event()
    answers = {"held": 0, "all": 0}

    def reader() -> None:
        while not stop.is_set():
            answers["held"] += bool(store.known_prefix(list(asked)))
            answers["all"] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            names = [f"t/m/raw-1-0/{i:04x}{k}" for k in range(8)]
            asked[:] = names[:1]
            assert await store.put_many([(n, chunk(k)) for k, n in enumerate(names)]) == [False] * 8
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert answers["all"] > 1000 and answers["held"] == 0
    await store.close()


async def test_a_read_the_backend_failed_keeps_the_name_and_reads_the_copy_below() -> None:
    """Backends answer a read that failed (a reset connection, a 5xx, EIO) as absent and
    count the error. The store must not take that for "gone": it serves the write-through
    copy below, keeps the name in the upper tier's books, tells on_gone nothing, and once
    the upper tier answers again serves from there."""

    class Faulty(MemoryBackend):
        failing = False

        async def get_many(self, names, alloc=None):  # type: ignore[no-untyped-def]
            if self.failing:  # as the Redis, S3 and disk backends answer a failed read
                self.counters.get_errors += len(names)
                self.counters.misses += len(names)
                return [None] * len(names)
            return await super().get_many(names, alloc)

    upper, lower = Faulty("mem://"), MemoryBackend("mem://")
    store = TieredStore(
        [
            TierSpec(Tier(upper), capacity=1 << 20),
            TierSpec(Tier(lower), capacity=1 << 20, write="through"),
        ]
    )
    gone: list[str] = []
    store.on_gone = gone.extend
    assert await store.put_many([(name(1), chunk(1))]) == [True]
    await store.drain()
    upper.failing = True
    got = await store.get_many([name(1)])
    assert got[0] is not None and torch.equal(got[0], chunk(1))  # the copy below
    assert name(1) in store.placement.tiers[0].resident and gone == []
    upper.failing = False
    reads = upper.counters.gets
    got = await store.get_many([name(1)])
    assert got[0] is not None and torch.equal(got[0], chunk(1)) and upper.counters.gets > reads
    await store.close()


async def test_a_demotion_whose_copy_fails_is_an_announced_drop() -> None:
    """The upper tier gave a victim up for an incoming object; its copy to the tier below
    fails. The name leaves the store as an eviction from the last tier does: off every
    tier's books and backend, on_gone told (no caller goes on promising it), a counted
    error, and the next read a miss; nothing else is lost."""

    class RefusingPuts(MemoryBackend):
        refusing = False

        async def put_many(self, items):  # type: ignore[no-untyped-def]
            if self.refusing:
                return [False] * len(items)
            return await super().put_many(items)

    size = await frame_size()
    upper, lower = MemoryBackend("mem://"), RefusingPuts("mem://")
    store = TieredStore(
        [TierSpec(Tier(upper), capacity=3 * size), TierSpec(Tier(lower), capacity=100 * size)]
    )
    gone: list[str] = []
    store.on_gone = gone.extend
    await store.put_many([(name(i), chunk(i)) for i in range(3)])
    await store.drain()
    lower.refusing = True
    await store.put_many([(name(3), chunk(3))])  # a victim of the three goes down, and fails to land
    await store.drain()
    assert len(gone) == 1
    victim = gone[0]
    assert all(victim not in t.resident for t in store.placement.tiers)
    assert victim not in {i.name async for i in upper.list("")} | {i.name async for i in lower.list("")}
    assert await store.get_many([victim]) == [None]
    kept = [n for n in (name(i) for i in range(4)) if n != victim]
    got = await store.get_many(kept)
    assert all(t is not None and torch.equal(t, chunk(int(n[-6:]))) for n, t in zip(kept, got))
    assert 'kvstore_errors_total{op="put",tier="tier1"} 1.0' in store.metrics.text()
    await store.close()


async def test_a_name_whose_reads_keep_failing_leaves_the_books_after_a_few(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A tier away for a moment keeps its names; an object that fails every read (a
    file with an I/O error, a key of another type) is gone after UNANSWERED_LIMIT reads
    in a row, and on_gone hears of it, so LMCache stops being promised it."""
    from kvstore.tiered import reads
    from kvstore.tiered.reads import UNANSWERED_LIMIT

    monkeypatch.setattr(reads, "UNANSWERED_MIN_S", 0.0)

    backend, store, gone = await failing_store(1, 2, 3)
    backend.failing = frozenset({name(1)})
    for _ in range(UNANSWERED_LIMIT - 1):
        got = await store.get_many([name(1), name(2)])
        assert got[0] is None and torch.equal(got[1], chunk(2))
        assert name(1) in store.placement.tiers[0].resident and gone == []
    await store.get_many([name(3), name(1)])  # the tier answers the batch's other read: not away
    assert name(1) not in store.placement.tiers[0].resident and gone == [name(1)]
    assert name(2) in store.placement.tiers[0].resident and name(3) in store.placement.tiers[0].resident
    await store.close()


async def test_a_name_whose_lone_reads_keep_failing_leaves_the_books(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The object is read alone, batch after batch (as an engine retrieving one prompt
    does), while the tier answers other reads between: it leaves the books after
    UNANSWERED_LIMIT failed reads with answered ones between, on_gone hears of it, and a new put writes it again
    (it was a hit on every lookup and a miss on every read, for ever)."""
    from kvstore.tiered import reads
    from kvstore.tiered.reads import UNANSWERED_LIMIT

    monkeypatch.setattr(reads, "UNANSWERED_MIN_S", 0.0)

    backend, store, gone = await failing_store(1, 2)
    backend.failing = frozenset({name(1)})
    for _ in range(UNANSWERED_LIMIT + 1):  # the first failure has no answered read before it
        assert gone == [] and name(1) in store.placement.tiers[0].resident
        assert await store.get_many([name(1)]) == [None]
        got = await store.get_many([name(2)])
        assert torch.equal(got[0], chunk(2))
    assert name(1) not in store.placement.tiers[0].resident and gone == [name(1)]
    assert store.metrics.errors.labels("get unreadable", "tier0")._value.get() == 1
    backend.failing = frozenset()
    puts = backend.counters.puts
    await store.put_many([(name(1), chunk(1))])
    assert backend.counters.puts > puts
    assert torch.equal((await store.get_many([name(1)]))[0], chunk(1))
    await store.close()


async def test_a_name_failing_for_less_than_the_minimum_time_stays(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Part of a tier away while the rest answers (a cluster shard failing over): however
    many reads of a name fail between answered ones, it stays on the books until it has
    failed for UNANSWERED_MIN_S, and is served again once its part is back."""
    from kvstore.tiered import reads
    from kvstore.tiered.reads import UNANSWERED_LIMIT

    clock = [1000.0]
    monkeypatch.setattr(reads, "clock", lambda: clock[0])
    backend, store, gone = await failing_store(1, 2)
    backend.failing = frozenset({name(1)})
    for _ in range(3 * UNANSWERED_LIMIT):
        clock[0] += 1.0
        assert await store.get_many([name(1)]) == [None]
        assert torch.equal((await store.get_many([name(2)]))[0], chunk(2))
        assert await store.get_many([name(1), name(2)]) != [None, None]
    assert gone == [] and name(1) in store.placement.tiers[0].resident
    backend.failing = frozenset()
    assert torch.equal((await store.get_many([name(1)]))[0], chunk(1))
    backend.failing = frozenset({name(1)})  # and failing for longer than the minimum: gone
    for _ in range(UNANSWERED_LIMIT + 1):
        clock[0] += reads.UNANSWERED_MIN_S
        await store.get_many([name(1)])
        await store.get_many([name(2)])
    assert gone == [name(1)]
    await store.close()


async def test_failures_long_apart_start_a_new_count(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Failed reads of a name more than UNANSWERED_FORGET_S apart do not add up: two old
    ones do not shorten the grace of a later outage."""
    from kvstore.tiered import reads
    from kvstore.tiered.reads import UNANSWERED_LIMIT

    clock = [1000.0]
    monkeypatch.setattr(reads, "clock", lambda: clock[0])
    monkeypatch.setattr(reads, "UNANSWERED_MIN_S", 0.0)
    backend, store, gone = await failing_store(1, 2)
    backend.failing = frozenset({name(1)})
    for _ in range(3 * UNANSWERED_LIMIT):  # each failure long after the one before
        clock[0] += reads.UNANSWERED_FORGET_S + 1
        assert await store.get_many([name(1), name(2)]) != [None, None]
    assert gone == [] and name(1) in store.placement.tiers[0].resident
    for _ in range(UNANSWERED_LIMIT):  # close together: they count
        clock[0] += 1
        await store.get_many([name(1), name(2)])
    assert gone == [name(1)]
    await store.close()


async def test_lone_reads_while_the_tier_is_away_keep_the_name() -> None:
    """Failed reads of one name with nothing answered between them (the tier away) do
    not count, however many; one answered read between two failures counts one."""
    from kvstore.tiered.reads import UNANSWERED_LIMIT

    backend, store, gone = await failing_store(1, 2)
    await store.get_many([name(2)])
    for _outage in range(UNANSWERED_LIMIT - 1):
        backend.away = True
        for _ in range(5):
            assert await store.get_many([name(1)]) == [None]
        backend.away = False
        await store.get_many([name(2)])
    assert gone == [] and name(1) in store.placement.tiers[0].resident
    assert torch.equal((await store.get_many([name(1)]))[0], chunk(1))
    await store.close()


async def test_a_tier_failing_every_read_keeps_its_names_however_long() -> None:
    """Away (restarting, unreachable) as far as every read can tell: no name is taken for
    gone, however many reads fail; once it answers, every one is served from it."""

    backend, store, gone = await failing_store(1, 2)
    backend.away = True
    for _ in range(5):
        assert await store.get_many([name(1), name(2)]) == [None, None]
        assert await store.get_many([name(1)]) == [None]
    assert gone == [] and {name(1), name(2)} <= set(store.placement.tiers[0].resident)
    backend.away = False
    got = await store.get_many([name(1), name(2)])
    assert torch.equal(got[0], chunk(1)) and torch.equal(got[1], chunk(2))
    await store.close()


async def two_tier_store(hot_chunks: int, cold: MemoryBackend, cold_chunks: int = 100) -> TieredStore:
    """A memory tier of `hot_chunks` chunks over `cold` (`cold_chunks` chunks)."""
    probe = TieredStore.from_urls(["mem://"])
    await probe.put_many([(name(0), chunk(0))])
    size = probe.placement.tiers[0].used
    await probe.close()
    hot = MemoryBackend("mem://", capacity=hot_chunks * size)
    return TieredStore(
        [TierSpec(Tier(hot), capacity=hot_chunks * size), TierSpec(Tier(cold), capacity=cold_chunks * size)]
    )


async def test_a_name_deleted_and_stored_again_while_its_promotion_runs_serves_the_new_bytes() -> None:
    """A promotion decided before a name was deleted and stored again carries the object
    before: reads serve the new bytes, before and after that promotion would have landed."""
    warm = HeldMemoryBackend()
    store = await two_tier_store(2, warm)
    for i in (1, 2, 3):
        await store.put_many([(name(i), chunk(i))])
        await store.drain()
    x = next(name(i) for i in (1, 2, 3) if store.placement.where(name(i)) == 1)
    (got,) = await store.get_many([x])  # a hit in the lower tier: its promotion starts
    assert got is not None
    warm.reads_in.clear()  # the promotion's read of the old bytes waits
    await asyncio.sleep(0)
    assert await store.delete_many([x]) == [True]
    new = torch.full((N,), -7.0)
    assert await store.put_many([(x, new)]) == [True]
    reading = asyncio.ensure_future(store.get_many([x]))
    await asyncio.sleep(0.05)
    warm.reads_in.set()
    (got,) = await reading
    assert got is not None and torch.equal(got, new)
    await store.drain()
    (got,) = await store.get_many([x])
    assert got is not None and torch.equal(got, new)
    await store.close()


async def test_a_put_cancelled_while_its_drops_run_leaves_no_move_half_done() -> None:
    """A store call cancelled (its caller's deadline) while the drops its plan decided are
    under way: the demotions that plan decided still run, nothing stays 'in flight', and
    later stores into the full tier do not wait for room that never comes."""
    cold = HeldMemoryBackend()
    store = await two_tier_store(2, cold, cold_chunks=1)
    for i in (1, 2, 3):
        await store.put_many([(name(i), chunk(i))])
        await store.drain()
    demoted = [n for n in store.placement.tiers[1].resident]
    cold.deletes.clear()  # the last tier's deletes hang
    put = asyncio.ensure_future(store.put_many([(name(4), chunk(4))]))
    await asyncio.sleep(0.05)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    cold.deletes.set()
    await store.drain()
    assert not store.inflight._copies and not store.inflight._landing
    assert store.mover.leaving == [{}, {}]
    held = [n for n in store.placement.tiers[1].resident]
    assert held and held != demoted  # the plan's demotion landed in the lower tier
    (got,) = await store.get_many(held)
    assert got is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i in (5, 6):
        await store.put_many([(name(i), chunk(i))])
    assert loop.time() - started < 1.0
    await store.close()


class SlowPutMemoryBackend(MemoryBackend):
    """A memory backend whose writes take `delay` seconds."""

    delay = 0.0

    async def put_many(self, items):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.delay)
        return await super().put_many(items)


async def test_a_store_call_cancelled_before_its_write_landed_promises_nothing() -> None:
    """A store the caller stopped waiting for (its deadline) is off the books: no lookup
    promises the chunk, and storing it again writes it (not a touch of bytes that are
    not there)."""
    backend = SlowPutMemoryBackend("mem://")
    store = TieredStore([TierSpec(Tier(backend), capacity=1 << 20)])
    backend.delay = 1.0
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(store.put_many([(name(1), chunk(1))]), 0.1)
    assert store.placement.where(name(1)) is None
    assert await store.contains_many([name(1)]) == [False]
    backend.delay = 0.0
    assert await store.put_many([(name(1), chunk(1))]) == [True]
    (got,) = await store.get_many([name(1)])
    assert got is not None and torch.equal(got, chunk(1))
    await store.close()


@pytest.mark.parametrize("timeout_s", [0.5, 5.0, 20.0])
def test_a_store_task_outlasts_its_tiers_write_deadline(timeout_s: float) -> None:
    """The deadline of a store task (L2 adapter, in-process runtime) leaves the tiers'
    own write deadline room to fire first: a tier too slow to write opens its breaker
    (later stores skip it) instead of every store task timing out."""
    from kvstore.store_config import StoreConfig
    from kvstore.tiered.guard import write_deadline

    cfg = StoreConfig.from_mapping({"tiers": ["mem://"], "timeout_s": timeout_s}, prefix="")
    tier_write = write_deadline(cfg.timeout_s / 2)
    assert tier_write is not None and cfg.store_deadline_s() >= tier_write + 15


class NextPutHeldMemoryBackend(MemoryBackend):
    """A memory backend whose next put, once `hold_next` is called, waits for `release`."""

    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._gate: asyncio.Event | None = None
        self.held = asyncio.Event()

    def hold_next(self) -> None:
        self._gate = self._holding = asyncio.Event()

    def release(self) -> None:
        self._holding.set()

    async def put_many(self, items):  # type: ignore[no-untyped-def]
        gate, self._gate = self._gate, None
        if gate is not None:
            self.held.set()
            await gate.wait()
        return await super().put_many(items)


async def test_a_promotion_landing_after_the_name_was_written_anew_does_not_stay() -> None:
    """A promotion of the object before, still writing when the name is stored anew and
    the new write stops waiting for it (its bound) and lands first: the promotion's old
    bytes are taken out again, so a read is the new object or a counted miss, never
    the object before."""
    probe = TieredStore.from_urls(["mem://"])
    await probe.put_many([(name(0), chunk(0))])
    size = probe.placement.tiers[0].used
    await probe.close()
    hot = NextPutHeldMemoryBackend("mem://", capacity=2 * size)
    store = TieredStore(
        [TierSpec(Tier(hot), capacity=2 * size), TierSpec(Tier(MemoryBackend("mem://")), capacity=100 * size)],
        tier_timeout=0.2,
    )
    for i in (1, 2, 3):
        await store.put_many([(name(i), chunk(i))])
        await store.drain()
    x = next(name(i) for i in (1, 2, 3) if store.placement.where(name(i)) == 1)
    hot.hold_next()  # the promotion's write into the top tier waits
    (old,) = await store.get_many([x])
    assert old is not None
    await asyncio.wait_for(hot.held.wait(), 5)
    assert await store.delete_many([x]) == [True]
    new = torch.full((N,), -9.0)
    assert await store.put_many([(x, new)]) == [True]  # waited 0.2 s for the promotion, then wrote
    hot.release()
    await store.drain()
    (got,) = await store.get_many([x])
    assert got is None or torch.equal(got, new)
    await store.close()
