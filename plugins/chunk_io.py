"""Moving LMCache MemoryObjs through the store: one copy on read, none on write.

Owns: the coroutines both plugins run on the store's loop to write MemoryObjs (their
tensors are the payload, not copied) and to read into MemoryObjs allocated from
LMCache's CPU allocator (decoded straight into them).  Must not touch: deadlines and
reference counts of LMCache's objects beyond the reads' own allocations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore_lmcache.keymap import allocation_for, byte_target, kv_groups, payload_of
from kvstore_lmcache.runtime import PluginCounters

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.plugins")


async def write_chunks(
    store: Any, names: Sequence[str], objs: Sequence[MemoryObj], *, parent: str | None = None
) -> list[bool]:
    """Store consecutive chunks of one prompt, in order; True for each name held afterwards.

    `parent` names the chunk just before ``names[0]`` when the caller knows it.  Names
    the store holds already are a touch there, not a rewrite.
    """
    ok = [False] * len(names)
    by_layout: dict[str, list[int]] = {}
    payloads = {}
    for i, obj in enumerate(objs):
        if kv_groups(obj) > 1:  # not read back in-process yet: storing it would promise a miss
            _warn_multi_group()
            continue
        payloads[i], layout = payload_of(obj)
        by_layout.setdefault(layout, []).append(i)
    chained = len(by_layout) == 1  # one layout: the batch is the prompt's chunks in order
    for layout, idx in by_layout.items():
        res = await store.put_many(
            [(names[i], payloads[i]) for i in idx],
            chained=chained,
            parent=parent if chained else None,
            layout=layout,
        )
        for i, r in zip(idx, res):
            ok[i] = r
    return ok


_warned: set[str] = set()


def _warn_multi_group() -> None:
    if "multi-group" not in _warned:
        _warned.add("multi-group")
        log.warning(
            "kvstore: chunks of several KV groups (a hybrid model) are not stored in-process: "
            "this plugin cannot read them back yet; use LMCache's MP mode (the L2 adapter) for this model"
        )


async def read_chunks(
    store: Any, names: Sequence[str], allocator: Any, counters: PluginCounters, *, prefix_only: bool = False
) -> list[MemoryObj | None]:
    """MemoryObjs (ref count 1, owned by the caller) for `names`; None for each miss.

    With ``prefix_only`` the result stops at the first miss (LMCache's async loading
    wants a contiguous prefix) and every object after it is released.  An object whose
    KV is not of the geometry of the allocator's engine (its ``metadata``) is a miss.
    """
    places = Allocations(len(names), allocator, counters)
    objs = places.objs
    done = False
    try:
        tensors = await store.get_many(names, out=places.outs())
        out: list[Any] = []
        for i, t in enumerate(tensors):
            obj = objs[i]
            if t is None or (prefix_only and len(out) < i):
                if obj is not None:
                    obj.ref_count_down()
                if t is None:
                    counters.get_misses += 1
                if prefix_only:
                    continue
                out.append(None)
            else:
                counters.get_hits += 1
                out.append(obj)
        done = True
        return out
    finally:
        if not done:  # cancelled by a deadline or failed: give every allocation back
            places.release()


class Allocations:
    """The MemoryObjs one read allocates from LMCache's allocator as each object's
    header arrives (``outs()``: one callable target per name), of the geometry of the
    allocator's engine (`allocation_for`: another geometry is refused, so a miss)."""

    def __init__(self, n: int, allocator: Any, counters: PluginCounters) -> None:
        self.objs: list[Any] = [None] * n
        self.allocator = allocator
        self.counters = counters
        self.metadata = getattr(allocator, "metadata", None)
        self.closed = False  # the read's caller left: allocate nothing more (the read then stops)

    def outs(self, *, described: bool = False) -> list[Any]:
        """A target per name; ``described``: each allocation handed over as a
        `ByteTarget` (no tensor view made; `TieredStore.read_now` only), else its tensor."""
        return [partial(self._alloc, i, described) for i in range(len(self.objs))]

    def _alloc(self, i: int, described: bool, header: Any) -> Any:
        if self.closed:
            return None
        shape, dtype, fmt = allocation_for(header, self.metadata)
        earlier = self.objs[i]
        if earlier is not None:  # a read that fell back to another tier: its first place goes back
            self.objs[i] = None
            earlier.ref_count_down()
        obj = self.allocator.allocate(shape, dtype, fmt, eviction=True, busy_loop=False)
        if obj is None:
            self.counters.alloc_failed += 1
            return None
        self.objs[i] = obj
        return (byte_target(obj) if described else None) or obj.tensor

    def release(self) -> None:
        """Give every allocation back to LMCache's allocator."""
        for i, obj in enumerate(self.objs):
            if obj is not None:
                self.objs[i] = None
                obj.ref_count_down()


async def prefix_count(store: Any, names: Sequence[str]) -> int:
    return await store.prefix_lookup(names)


__all__ = ["Allocations", "prefix_count", "read_chunks", "write_chunks"]
