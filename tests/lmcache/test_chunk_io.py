"""plugins/chunk_io.py: reads into LMCache memory objects give back every allocation
they do not hand to the caller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import torch

from kvstore_lmcache.chunk_io import read_chunks
from kvstore_lmcache.runtime import PluginCounters


class _Obj:
    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.tensor = torch.zeros(shape, dtype=dtype)
        self.refs = 1

    def ref_count_down(self) -> None:
        self.refs -= 1


class _Allocator:
    def __init__(self) -> None:
        self.made: list[_Obj] = []

    def allocate(self, shape: torch.Size, dtype: torch.dtype, fmt: Any, **_: Any) -> _Obj:
        self.made.append(_Obj(shape, dtype))
        return self.made[-1]


class _FallingBackStore:
    """Places each name twice, as a read does that falls back to a lower tier after the
    first tier took a place and then failed; the second place is the one returned."""

    async def get_many(self, names: list[str], out: list[Any]) -> list[torch.Tensor | None]:
        header = SimpleNamespace(layout="lmcache:KV_2LTD", dtype="float32", shape=(2, 4))
        got = []
        for place in out:
            place(header)  # the first tier's place, then a fault there
            t = place(header)  # the copy below
            t.fill_(1.0)
            got.append(t)
        return got


def test_a_read_that_falls_back_gives_its_first_place_back() -> None:
    allocator = _Allocator()
    objs = asyncio.run(read_chunks(_FallingBackStore(), ["a", "b"], allocator, PluginCounters()))
    assert len(allocator.made) == 4
    first, handed = allocator.made[0::2], allocator.made[1::2]
    assert [o.refs for o in first] == [0, 0]  # given back: LMCache's pool does not shrink
    assert objs == handed and all(o.refs == 1 and bool((o.tensor == 1).all()) for o in handed)


class _PoolAllocator:
    """Allocates as LMCache's tensor allocator does: uint8 slices of one pool."""

    def __init__(self) -> None:
        self.pool = torch.zeros(1 << 16, dtype=torch.uint8)
        self.at = 0

    def allocate(self, shape: torch.Size, dtype: torch.dtype, fmt: Any, **_: Any) -> Any:
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

        size = shape.numel() * dtype.itemsize
        raw = self.pool[self.at : self.at + size]
        meta = MemoryObjMetadata(shape, dtype, self.at, size, 1, 0, fmt, shapes=[shape], dtypes=[dtype])
        self.at += size
        return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def test_places_for_a_read_off_the_loop_are_described_and_write_into_the_allocation() -> None:
    """`outs(described=True)` (the blocking read off the store's loop) hands each
    allocation over as a `ByteTarget` over its own memory; the loop's read gets tensors;
    an allocator's object that cannot be described gets its tensor either way."""
    from kvstore.tier_stream import ByteTarget
    from kvstore_lmcache.chunk_io import Allocations

    header = SimpleNamespace(layout="lmcache:KV_2LTD", dtype="float32", shape=(2, 4))
    places = Allocations(2, _PoolAllocator(), PluginCounters())
    described, plain = places.outs(described=True)[0](header), places.outs()[1](header)
    assert isinstance(described, ByteTarget) and (described.shape, described.dtype) == ((2, 4), "float32")
    assert isinstance(plain, torch.Tensor) and plain.shape == (2, 4)
    described.data[:] = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    assert torch.equal(places.objs[0].tensor, torch.arange(8, dtype=torch.float32).view(2, 4))
    fake = Allocations(1, _Allocator(), PluginCounters())
    assert isinstance(fake.outs(described=True)[0](header), torch.Tensor)
