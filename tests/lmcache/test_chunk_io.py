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
