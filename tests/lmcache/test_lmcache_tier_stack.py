"""The tier stack the plugins run on: write-through, read hottest first, promote, miss on faults."""

from __future__ import annotations

import uuid

import torch

from kvstore.tier_stack import TierStack


def _stack(tmp_path, n=2) -> TierStack:
    urls = [f"mem://ts-{uuid.uuid4().hex[:6]}", f"file://{tmp_path / 'warm'}?fsync=false"][:n]
    return TierStack.open([(u, "raw") for u in urls])


async def test_write_through_and_read_from_the_lower_tier(tmp_path):
    st = _stack(tmp_path)
    t = torch.arange(4096, dtype=torch.float32).view(2, 2048)
    assert await st.put_many(["ns/m/f-1-0/1"], [t], layout="lmcache:KV_2LTD") == [True]
    await st.tiers[0].delete_many(["ns/m/f-1-0/1"])  # hot copy gone, as after a restart
    out = torch.empty_like(t)
    got, src = await st.get_many_with_source(["ns/m/f-1-0/1", "ns/m/f-1-0/2"], out=[out, torch.empty_like(t)])
    assert src == [1, None] and got[1] is None
    assert got[0] is out and torch.equal(out, t)
    await st.drain()  # promotion back into the hot tier
    assert await st.tiers[0].contains_many(["ns/m/f-1-0/1"]) == [True]
    assert await st.prefix_lookup(["ns/m/f-1-0/1", "ns/m/f-1-0/2", "ns/m/f-1-0/1"]) == 1
    s = st.stats()
    assert s.hits == [0, 1] and s.misses == 1
    await st.close()


async def test_callable_out_allocates_the_stored_shape(tmp_path):
    st = _stack(tmp_path, 1)
    t = torch.ones(3, 5, dtype=torch.bfloat16)
    await st.put_many(["a/b/c-1-0/9"], [t], layout="lmcache:KV_2LTD")
    seen = []

    def alloc(header):
        seen.append((tuple(header.shape), header.dtype, header.layout))
        return torch.zeros(header.shape, dtype=torch.bfloat16)

    (got,) = await st.get_many(["a/b/c-1-0/9"], out=[alloc])
    assert seen == [((3, 5), "bfloat16", "lmcache:KV_2LTD")]
    assert torch.equal(got, t)
    # a buffer of the wrong shape is a counted miss, not an exception and not a quarantine
    (bad,) = await st.get_many(["a/b/c-1-0/9"], out=[torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert bad is None and st.stats().decode_errors == 1
    assert await st.contains_many(["a/b/c-1-0/9"]) == [True]
    await st.close()
