"""Property tests of the multi-tier bookkeeping: budgets, protection, and moves that add up."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy import (
    ONLINE_POLICIES,
    ChunkMeta,
    Copy,
    Drop,
    Move,
    Placement,
    TierState,
    Write,
    WriteBatch,
    make_policy,
)

KEYS = [f"k{i}" for i in range(24)]

op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(KEYS), st.integers(1, 40)),
    st.tuples(st.just("hit"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.just(0)),
)


def apply(physical: list[set[str]], moves: list[Move]) -> None:
    """What a store does with the moves: the physical contents of each tier."""
    for m in moves:
        if isinstance(m, Write):
            physical[m.dst].add(m.key)
        elif isinstance(m, Copy):
            physical[m.dst].add(m.key)
            if m.kind == "demote":
                physical[m.src].discard(m.key)
        else:
            assert isinstance(m, Drop)
            physical[m.src].discard(m.key)


SELECTIVE_ADMISSION = {"reuse"}


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(ONLINE_POLICIES),
    caps=st.lists(st.integers(40, 160), min_size=1, max_size=3),
    through=st.booleans(),
    low=st.sampled_from([1.0, 0.8]),
    ops=st.lists(op, max_size=120),
    pinned=st.sets(st.sampled_from(KEYS), max_size=3),
)
def test_placement_bookkeeping(policy, caps, through, low, ops, pinned) -> None:  # type: ignore[no-untyped-def]
    tiers = [
        TierState(c, make_policy(policy, c), write="through" if through and i else "back", low=low)
        for i, c in enumerate(caps)
    ]
    pl = Placement(tiers)
    physical: list[set[str]] = [set() for _ in tiers]
    for kind, key, size in ops:
        before = [set(t.resident) for t in tiers]
        if kind == "store":
            moves = pl.store(key, size, ChunkMeta(), protected=pinned)
        elif kind == "hit":
            moves = pl.hit(key, protected=pinned)
        else:
            moves = pl.delete(key)
        apply(physical, moves)
        for i, t in enumerate(tiers):
            assert t.used == sum(t.resident.values()) <= t.capacity
            assert len(t.policy) == len(t.resident)
            assert all(k in t.policy for k in t.resident)
            assert physical[i] == set(t.resident), f"moves disagree with tier {i} after {kind} {key}"
            if kind != "delete":
                # a protected key is never evicted from where it was
                assert (before[i] & pinned) <= set(t.resident)
        held = {k for t in tiers for k in t.resident}
        assert set(pl.meta) <= held
        if kind == "store" and pl.where(key) is None and policy not in SELECTIVE_ADMISSION:
            # refused only when it cannot fit the top tier at all (policies that admit
            # selectively may also refuse a chunk they predict will not be reused)
            assert size + sum(tiers[0].resident.get(p, 0) for p in pinned) > tiers[0].capacity


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
def test_victims_are_demoted_not_dropped(policy: str) -> None:
    pl = Placement([TierState(3, make_policy(policy, 3)), TierState(100, make_policy(policy, 100))])
    for i in range(10):
        pl.store(f"k{i}", 1)
    assert all(pl.where(f"k{i}") is not None for i in range(10))
    assert len(pl.tiers[0].resident) == 3 and len(pl.tiers[1].resident) == 7


def test_hit_in_a_lower_tier_is_promoted_and_the_lower_copy_kept() -> None:
    pl = Placement([TierState(2, make_policy("lru", 2)), TierState(10, make_policy("lru", 10))])
    for k in "abc":
        pl.store(k, 1)
    assert pl.where("a") == 1
    moves = pl.hit("a")
    assert moves[0] == Copy("promote", "a", 1, 1, 0)
    assert pl.holders("a") == [0, 1]
    # b was the top tier's LRU: demoted to make room
    assert Copy("demote", "b", 1, 0, 1) in moves


def test_write_through_lands_in_both_tiers_and_victims_of_the_top_are_just_dropped() -> None:
    pl = Placement(
        [TierState(2, make_policy("lru", 2)), TierState(10, make_policy("lru", 10), write="through")]
    )
    kinds = [m.kind for k in "abc" for m in pl.store(k, 1)]
    assert kinds.count("write") == 6
    assert pl.holders("a") == [1] and pl.holders("c") == [0, 1]
    assert "demote" not in kinds


def test_watermarks_evict_down_to_the_low_mark() -> None:
    pl = Placement([TierState(10, make_policy("lru", 10), high=0.9, low=0.5)])
    for i in range(9):
        pl.store(f"k{i}", 1)
    assert pl.tiers[0].used == 9
    pl.store("k9", 1)  # would pass 90%: evict to 50% first
    assert pl.tiers[0].used == 5
    with pytest.raises(ValueError, match="watermarks"):
        TierState(10, make_policy("lru", 10), high=0.5, low=0.9)


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(ONLINE_POLICIES),
    caps=st.lists(st.integers(20, 80), min_size=1, max_size=3),
    through=st.booleans(),
    chained=st.booleans(),
    batches=st.lists(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 20)), max_size=10), max_size=12),
)
def test_a_write_batch_never_loses_its_own_chunks(policy, caps, through, chained, batches) -> None:  # type: ignore[no-untyped-def]
    """Batches of writes over 1-3 tiers: the moves still add up, and no chunk a batch
    stored or touched leaves the store while later chunks of that batch are placed (it
    may move down a tier, never out), for every policy."""
    tiers = [TierState(c, make_policy(policy, c), write="through" if through and i else "back") for i, c in enumerate(caps)]
    pl = Placement(tiers)
    physical: list[set[str]] = [set() for _ in tiers]
    for items in batches:
        batch = WriteBatch()
        prev = None
        kept: set[str] = set()
        for depth, (key, size) in enumerate(items):
            meta = ChunkMeta(depth=depth, parent=prev) if chained else ChunkMeta()
            apply(physical, pl.store(key, size, meta, batch=batch))
            prev = key
            for i, t in enumerate(tiers):
                assert t.used == sum(t.resident.values()) <= t.capacity
                assert physical[i] == set(t.resident)
            lost = {k for k in kept if pl.where(k) is None}
            assert not lost, f"{policy}: the batch's own chunks {lost} were evicted for its later ones"
            if pl.where(key) is not None:
                kept.add(key)
