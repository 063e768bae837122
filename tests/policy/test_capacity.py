"""``capacity`` is the byte budget of a tier's medium, also through a TieredStore: the
disk backend enforces it for every process sharing the directory (the hard bound), the
store's engine places within the same number and acts first, names a backend evicts
leave the store's books, and a read of an evicted name is a counted miss, never an error."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from kvstore.backends.disk import DiskBackend
from kvstore.store_config import StoreConfig
from kvstore.tiered import TieredStore
from tests.support.disk import on_disk

CHUNK = 16 << 10  # float32 elements: 64 KiB of payload per chunk


def chunk(i: int) -> torch.Tensor:
    return torch.full((CHUNK,), float(i), dtype=torch.float32)


async def frame_size() -> int:
    probe = TieredStore.from_urls(["mem://"])
    await probe.put_many([("t/probe", chunk(0))])
    size = probe.placement.tiers[0].used
    await probe.close()
    return size


def misses(store: TieredStore) -> float:
    return sum(
        s.value for m in store.metrics.misses.collect() for s in m.samples if s.name.endswith("_total")
    )


SERVER = """
import asyncio, json, sys
import torch
from kvstore.store_config import StoreConfig
async def main():
    root, tag = sys.argv[1], sys.argv[2]
    store = StoreConfig.from_mapping({"kvstore.tiers": [f"file://{root}?capacity=4MiB&fsync=false"]}).build()
    names = []
    for batch in range(12):
        items = [(f"t/{tag}/o{batch}-{i}", torch.full((16 << 10,), float(i))) for i in range(6)]
        await store.put_many(items)  # False where the engine evicted it again at once
        names += [n for n, _ in items]
    got = await store.get_many(names)
    served = sum(t is not None for t in got)
    missed = sum(s.value for m in store.metrics.misses.collect() for s in m.samples if s.name.endswith("_total"))
    await store.close()
    print(json.dumps({"served": served, "missed": missed, "asked": len(names)}))
asyncio.run(main())
"""


async def test_two_processes_through_store_config_keep_the_disk_capacity(tmp_path: Path) -> None:
    """Two serving processes (StoreConfig.build, as the plugins and the L2 adapter open
    their store) share one disk tier of capacity=4MiB: on-disk bytes never pass it by more
    than the writes in flight, and every name that is gone reads as a counted miss."""
    import json

    root = tmp_path / "disk"
    DiskBackend(root)  # created (and indexed) once
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SERVER,
            str(root),
            tag,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for tag in ("a", "b")
    ]
    peak = 0
    done = asyncio.gather(*(p.communicate() for p in procs))
    while not done.done():
        peak = max(peak, on_disk(root))
        await asyncio.sleep(0.002)
    outs = await done
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    size = await frame_size()
    in_flight = 2 * 4 * size  # two processes, four disk writes in flight each
    assert peak <= (4 << 20) + in_flight, peak
    assert on_disk(root) <= 4 << 20
    results = [json.loads(o[0]) for o in outs]
    for r in results:
        assert r["served"] + r["missed"] == r["asked"]  # every read answered: a hit or a counted miss
    assert all(r["missed"] > 0 for r in results)  # each stored more than the disk holds


async def test_names_the_backend_evicts_leave_the_books_and_read_as_counted_misses(tmp_path: Path) -> None:
    """Another process (here: a second backend on the same directory) adds bytes; the store's
    next writes make its disk backend evict the store's oldest names to stay under capacity:
    the store stops promising them (on_gone is told) and reading them is a counted miss."""
    size = await frame_size()
    cap = 10 * size
    store = TieredStore.from_urls([f"file://{tmp_path}?capacity={cap}&fsync=false"])
    gone: list[str] = []
    store.on_gone = gone.extend
    assert store.tiers[0].backend.capacity == store.placement.tiers[0].capacity == cap
    mine = [f"t/s{i}" for i in range(8)]
    for i, n in enumerate(mine[:6]):
        assert await store.put_many([(n, chunk(i))]) == [True]
    other = DiskBackend(tmp_path, capacity=cap, fsync=False)
    for i in range(4):
        parts = store.tiers[0].encode(chunk(100 + i), f"t/o{i}")
        assert await other.put_many([(f"t/o{i}", parts)]) == [True]
    assert on_disk(tmp_path) <= cap
    # the engine counts 6 of its own and places two more; the medium is full, so the backend evicts
    for i, n in enumerate(mine[6:], 6):
        assert await store.put_many([(n, chunk(i))]) == [True]
    assert on_disk(tmp_path) <= cap
    assert gone == ["t/s0", "t/s1"]
    assert await store.contains_many(mine) == [False, False] + [True] * 6
    assert store.stats().tiers[0].objects == 6
    # the other writer evicts two more of the store's names; the store learns on reading them
    for i in range(4, 6):
        parts = store.tiers[0].encode(chunk(100 + i), f"t/o{i}")
        assert await other.put_many([(f"t/o{i}", parts)]) == [True]
    before = misses(store)
    got = await store.get_many(mine)
    assert [t is not None for t in got] == [False] * 4 + [True] * 4
    assert all(torch.equal(t, chunk(i)) for i, t in enumerate(got) if t is not None)
    assert misses(store) - before == 4
    assert gone == ["t/s0", "t/s1", "t/s2", "t/s3"]
    assert store.stats().tiers[0].objects == 4
    await other.close()
    await store.close()


async def test_the_engine_demotes_before_the_backend_has_to_evict(tmp_path: Path) -> None:
    """One process, memory over disk, both bounded by capacity: the engine's demotions make
    the room, so neither backend evicts and nothing is lost."""
    size = await frame_size()
    store = TieredStore.from_urls(
        [f"mem://?capacity={4 * size}&policy=lru", f"file://{tmp_path}?capacity={40 * size}&fsync=false"]
    )
    for i in range(30):
        assert await store.put_many([(f"t/c{i}", chunk(i))]) == [True]
        if i % 7 == 0:
            assert (await store.get_many([f"t/c{i // 2}"]))[0] is not None
    await store.put_many([(f"t/b{i}", chunk(i)) for i in range(10)])  # a batch larger than the hot tier
    await store.drain()
    assert [t.backend.counters.evictions for t in store.tiers] == [0, 0]
    assert store.tiers[0].backend.stats().bytes <= 4 * size
    got = await store.get_many([f"t/c{i}" for i in range(30)] + [f"t/b{i}" for i in range(10)])
    assert all(t is not None for t in got)
    await store.close()


def test_store_config_reads_each_tier_url_once() -> None:
    cfg = StoreConfig.from_mapping(
        {
            "kvstore.tiers": [
                "mem://hot?capacity=1GiB&policy=lru",
                "file:///tmp/kv-x?capacity=2GiB&fsync=false&write=back",
            ]
        }
    )
    hot, warm = cfg.tiers
    assert (hot.options.capacity, hot.options.policy, hot.backend_url) == (
        1 << 30,
        "lru",
        "mem://hot?capacity=1GiB",
    )
    assert (warm.options.capacity, warm.options.write) == (2 << 30, "back")
    assert warm.backend_url == "file:///tmp/kv-x?capacity=2GiB&fsync=false"
    assert [cfg.write_mode(i) for i in range(2)] == ["back", "back"]
    cfg = StoreConfig.from_mapping({"kvstore.tiers": "mem://hot redis://localhost:6379/0?capacity=1GiB"})
    assert cfg.write_mode(1) == "through"
    # Redis enforces no budget itself: the capacity is this process's placement budget only
    assert cfg.tiers[1].backend_url == "redis://localhost:6379/0" and cfg.tiers[1].options.capacity == 1 << 30
