"""What the plugins need from TieredStore: layout tags, callable `out`, pooled reads,
objects found in a shared tier, chain metadata, and the config that builds it."""

from __future__ import annotations

import uuid

import torch

from kvstore.buffers import BufferPool
from kvstore.store_config import StoreConfig
from kvstore.tiered import TieredStore


def _store(tmp_path, n=2, **kw) -> TieredStore:
    urls = [f"mem://ts-{uuid.uuid4().hex[:6]}", f"file://{tmp_path / 'warm'}?fsync=false&write=through"][:n]
    return TieredStore.from_urls(urls, **kw)


async def test_callable_out_allocates_the_stored_shape(tmp_path):
    st = _store(tmp_path, 1)
    t = torch.ones(3, 5, dtype=torch.bfloat16)
    assert await st.put_many([("a/b/c-1-0/9", t)], layout="lmcache:KV_2LTD") == [True]
    seen = []

    def alloc(header):
        seen.append((tuple(header.shape), header.dtype, header.layout))
        return torch.zeros(header.shape, dtype=torch.bfloat16)

    (got,) = await st.get_many(["a/b/c-1-0/9"], out=[alloc])
    assert seen == [((3, 5), "bfloat16", "lmcache:KV_2LTD")]
    assert torch.equal(got, t)
    # a buffer of the wrong shape, or a caller that declines, is a miss: the object stays
    (bad,) = await st.get_many(["a/b/c-1-0/9"], out=[torch.zeros(2, 2, dtype=torch.bfloat16)])
    (skipped,) = await st.get_many(["a/b/c-1-0/9"], out=[lambda header: None])
    assert bad is None and skipped is None and st.stats().declined == 2
    assert await st.contains_many(["a/b/c-1-0/9"]) == [True]
    await st.close()


async def test_disk_reads_land_in_out_and_are_promoted(tmp_path):
    st = _store(tmp_path)
    names = [f"ns/m/f-1-0/{i}" for i in range(3)]
    ts = [torch.full((256, 1024), float(i)) for i in range(3)]
    assert await st.put_many(list(zip(names, ts))) == [True] * 3
    await st.tiers[0].delete_many(names)  # only the disk copies answer now
    st.placement.tiers[0].resident.clear()
    outs = [torch.empty(256, 1024) for _ in names]
    got = await st.get_many(names, out=outs)
    assert all(g is o and torch.equal(o, t) for g, o, t in zip(got, outs, ts))
    assert st.pool.pooled_bytes == 0, "streamed into `out`: no read buffer in between"
    await st.drain()
    assert await st.tiers[0].contains_many(names) == [True] * 3, "disk hits are promoted"
    await st.close()


async def test_a_second_store_finds_what_the_first_wrote(tmp_path):
    first = _store(tmp_path)
    t = torch.arange(4096, dtype=torch.float32).view(2, 2048)
    names = ["ns/m/f-1-0/1", "ns/m/f-1-0/2"]
    await first.put_many([(names[0], t), (names[1], t + 1)], chained=True)
    await first.close()

    again = _store(tmp_path, discover=True)  # a new process: empty memory, same disk
    assert await again.prefix_lookup([*names, "ns/m/f-1-0/3"]) == 2
    out = torch.empty_like(t)
    (got, miss) = await again.get_many([names[0], "ns/m/f-1-0/3"], out=[out, torch.empty_like(t)])
    assert got is out and torch.equal(out, t) and miss is None
    assert again.placement.where(names[0]) is not None and again.stats().discovered == 1
    await again.drain()
    assert again.placement.where(names[0]) == 0, "adopted, then promoted to memory"
    await again.close()

    blind = _store(tmp_path)  # without discovery the store only knows what it wrote
    assert await blind.prefix_lookup(names) == 0
    await blind.close()


async def test_chained_puts_record_the_prefix_chain(tmp_path):
    st = _store(tmp_path, 1)
    t = torch.zeros(8)
    await st.put_many([("p/m/f-1-0/a", t), ("p/m/f-1-0/b", t)], chained=True)
    await st.put_many([("p/m/f-1-0/c", t)], chained=True, parent="p/m/f-1-0/b")
    meta = st.placement.meta
    assert meta["p/m/f-1-0/b"].parent == "p/m/f-1-0/a"
    assert (meta["p/m/f-1-0/c"].parent, meta["p/m/f-1-0/c"].depth) == ("p/m/f-1-0/b", 2)
    await st.close()


async def test_config_builds_a_tiered_store_with_its_policy(tmp_path):
    cfg = StoreConfig.from_mapping(
        {
            "kvstore.tiers": ["mem://cfg-hot?capacity=1MiB", f"file://{tmp_path / 'w'}"],
            "kvstore.policy": "lru",
        }
    )
    st = cfg.build()
    assert isinstance(st, TieredStore) and st.discover
    assert [s.policy for s in st.specs] == ["lru", "lru"]
    assert [s.write for s in st.specs] == ["back", "through"], "lower tiers are written through"
    assert st.specs[0].capacity == 1 << 20
    await st.close()
    assert StoreConfig.from_mapping({"kvstore.tiers": ["mem://x"]}).policy == "chain"


def test_buffer_pool_reuses_and_stays_bounded():
    pool = BufferPool(max_bytes=3 << 20)
    a = pool.take(1 << 20)
    pool.give(a)
    assert pool.take(1 << 20) is a, "a returned buffer is handed out again"
    bufs = [pool.take(2 << 20) for _ in range(2)]
    for b in bufs:
        pool.give(b)
    assert pool.pooled_bytes == 2 << 20, "the second one did not fit under max_bytes"


async def test_copies_below_the_one_found_are_kept(tmp_path):
    urls = [
        f"mem://deep-{uuid.uuid4().hex[:6]}",
        f"file://{tmp_path / 'warm'}?fsync=false&write=through",
        f"file://{tmp_path / 'cold'}?fsync=false&write=through",
    ]
    first = TieredStore.from_urls(urls)
    t = torch.arange(1024, dtype=torch.float32)
    await first.put_many([("ns/m/f-1-0/7", t)])
    await first.close()
    again = TieredStore.from_urls([f"mem://deep-{uuid.uuid4().hex[:6]}", *urls[1:]], discover=True)
    (got,) = await again.get_many(["ns/m/f-1-0/7"], out=[torch.empty_like(t)])
    assert torch.equal(got, t)
    await again.drain()  # the promotion's cleanup must not take the cold copy for a stray
    assert await again.tiers[2].contains_many(["ns/m/f-1-0/7"]) == [True]
    assert again.placement.holders("ns/m/f-1-0/7") == [0, 1, 2]
    await again.close()
