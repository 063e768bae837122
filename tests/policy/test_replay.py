"""A live replay of a trace slice through a real TieredStore (memory → disk) hits exactly
as often, in every request and in every tier, as `kvstore simulate` says it should."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvstore.policy.simulate import TierModel, build_placement, replay
from kvstore.policy.trace import read_trace
from kvstore.tiered import TieredStore

SLICE = Path(__file__).parent / "data" / "mooncake_slice.jsonl"
HOT, WARM = 100, 2000  # blocks


def block_name(block: int) -> str:
    return f"trace/m/raw-1-0/{block:08x}"  # equal lengths: equal frame sizes


def payload(block: int) -> torch.Tensor:
    return torch.full((16,), float(block), dtype=torch.float32)


@pytest.mark.parametrize("policy", ["chain", "reuse", "lru"])
async def test_memory_to_disk_replay_matches_the_simulator(policy: str, tmp_path: Path) -> None:
    requests = read_trace(SLICE)
    probe = TieredStore.from_urls(["mem://"])
    await probe.put_many([(block_name(0), payload(0))])
    size = probe.placement.tiers[0].used
    await probe.close()

    # the simulator, request by request, on the same object names
    named = [replace(r, hash_ids=tuple(block_name(b) for b in r.hash_ids)) for r in requests]
    sim = build_placement([TierModel(HOT * size, policy), TierModel(WARM * size, policy)])
    expected = [replay(sim, [r], block_bytes=size) for r in named]

    store = TieredStore.from_urls(
        [
            f"mem://?capacity={HOT * size}&policy={policy}",
            f"file://{tmp_path}?capacity={WARM * size}&policy={policy}&fsync=false",
        ],
        max_moves=8,
    )
    got = []
    for k, r in enumerate(requests):
        names = [block_name(b) for b in r.hash_ids]
        n = await store.prefix_lookup(names)
        if n:
            tensors = await store.get_many(names[:n])
            for b, t in zip(r.hash_ids, tensors):
                assert t is not None and torch.equal(t, payload(b)), f"request {k}: wrong bytes for block {b}"
        got.append(n)
        await store.put_many(
            [(name, payload(b)) for name, b in zip(names[n:], r.hash_ids[n:])],
            chained=True,
            parent=names[n - 1] if n else None,
        )
        if k % 50 == 0:
            await store.drain()
    await store.drain()

    assert got == expected
    assert sum(got) > 400  # the slice does reuse blocks at these sizes
    for live, model in zip(store.placement.tiers, sim.tiers):
        assert live.counters.hits == model.counters.hits
        assert live.counters.evictions == model.counters.evictions
    assert sim.tiers[1].counters.hits > 0  # the disk tier served some of them
    # what the backends hold is what the engine believes
    for tier, state in zip(store.tiers, store.placement.tiers):
        assert {i.name async for i in tier.backend.list("")} == set(state.resident)
    await store.close()
