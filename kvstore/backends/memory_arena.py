"""The memory a bounded memory tier keeps its large objects in: one mapping, reused.

Owns: `Arena`, one anonymous mapping of the tier's ``capacity`` carved into page-aligned
`Region`s (first fit, neighbours merged when freed), optionally with every page made
present when it is opened (``MAP_POPULATE``, as LMCache touches its whole CPU pool at
start).  Must not touch: which objects are kept (the backend's LRU) or their bytes.

Why: an object copied into freshly allocated memory takes a page fault per 4 KiB page
on its first write.  Where faults are dear (the sandboxed kernel here: 55-95 ms to map
16 MiB while disk writes run, against ~2 ms to copy into pages already present) the
faults, not the copy, were the memory tier's put.  Pages of the arena, once touched,
stay: a full tier's next object lands where an evicted one was.

A region is handed out again only once no view of it can be alive.  Each region exports
its bytes through its own small buffer object (a ctypes array over the mapping), and
every memoryview of it, every slice of those and every buffer made from one (numpy
arrays, ``torch.frombuffer`` tensors) holds a reference to that object; a freed region
whose object's reference count is back to the arena's own is unviewed.  Until then it is
`retired` (still counted as taken).  On an interpreter without reference counts freed
regions are never reused.  The arena is not thread-safe: its owner serialises calls.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import platform
import sys
import sysconfig
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
ARENA_MIN = 256 << 10
"""Objects from this size up live in the arena; smaller ones in plain ``bytes`` (the
allocator's own arenas already reuse their pages)."""

# exact reference counts: CPython with its GIL (a free-threaded build defers some counts)
_COUNTS_REFERENCES = sys.implementation.name == "cpython" and not sysconfig.get_config_var("Py_GIL_DISABLED")
# address space only, backed as pages are touched: a capacity above free RAM is a bound,
# not an allocation (Linux's default overcommit refuses such a mapping without it).
# Python 3.11's mmap module lacks the constant; 0x4000 is its value on x86 and ARM Linux.
_LINUX_GENERIC = sys.platform.startswith("linux") and platform.machine() in {
    "x86_64",
    "aarch64",
    "i686",
    "armv7l",
}
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if _LINUX_GENERIC else 0)


def available_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(eq=False, slots=True)
class Region:
    """`length` bytes at `offset` of an arena (a whole number of pages)."""

    offset: int
    length: int
    exporter: ctypes.Array[ctypes.c_ubyte]

    def view(self, size: int) -> memoryview:
        """The first `size` bytes, writable (a view holds the region: see the module)."""
        return memoryview(self.exporter).cast("B")[:size]


class Arena:
    """Room for `capacity` bytes of objects in one mapping: the capacity rounded up to
    pages, plus a page per object it can hold for rounding each region up to pages.
    `OSError` when the system will not map it; with `populate`, also when it is more
    than the memory available (touching it all would end in the OOM killer, since
    ``MAP_POPULATE`` does not fail when pages run out)."""

    def __init__(self, capacity: int, *, populate: bool = False) -> None:
        slack = (capacity // ARENA_MIN + 1) * PAGE
        self.capacity = max(PAGE, -(-capacity // PAGE) * PAGE + slack)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate:
            free = available_memory()
            if free is not None and self.capacity > free:
                raise OSError(f"{self.capacity} bytes asked, {free} available (MemAvailable)")
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        else:
            flags |= _NORESERVE
        self._map = mmap.mmap(-1, self.capacity, flags=flags)
        self.populated = populate
        self._starts: list[int] = [0]  # free extents, sorted by offset
        self._lengths: dict[int, int] = {0: self.capacity}
        self._retired: list[Region] = []
        self.taken = 0  # bytes in regions handed out (retired ones included)

    @property
    def retired_bytes(self) -> int:
        return sum(r.length for r in self._retired)

    def alloc(self, size: int) -> Region | None:
        """A region of at least `size` bytes, or None when no free extent is that long
        (free more, or keep the object elsewhere)."""
        need = max(PAGE, -(-size // PAGE) * PAGE)
        if need > self.capacity:
            return None
        if self._retired:
            self.reclaim()  # regions whose last view has gone since they were freed
        for i, start in enumerate(self._starts):
            have = self._lengths[start]
            if have >= need:
                del self._starts[i]
                del self._lengths[start]
                if have > need:
                    self._starts.insert(i, start + need)
                    self._lengths[start + need] = have - need
                self.taken += need
                return Region(start, need, (ctypes.c_ubyte * need).from_buffer(self._map, start))
        return None

    def free(self, region: Region) -> None:
        """`region`'s object was dropped: its extent is free once nothing views it."""
        self._retired.append(region)
        self.reclaim()

    def reclaim(self) -> int:
        """Return the retired regions nothing views any more to the free extents; the
        bytes returned."""
        if not _COUNTS_REFERENCES:
            return 0
        back = 0
        keep: list[Region] = []
        for region in self._retired:
            if sys.getrefcount(region.exporter) <= _UNVIEWED:
                self._release(region.offset, region.length)
                back += region.length
            else:
                keep.append(region)
        self._retired = keep
        return back

    def _release(self, start: int, length: int) -> None:
        self.taken -= length
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + length == self._starts[i]:  # merge the next
            nxt = self._starts.pop(i)
            length += self._lengths.pop(nxt)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:  # merge into the previous
                self._lengths[prev] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length


def _unviewed_count() -> int:
    """The reference count of an exporter nothing views, as `reclaim` reads it (the
    region's reference and the call's argument: 2 on CPython 3.11), measured once."""
    probe = Region(0, 1, (ctypes.c_ubyte * 1)())
    return sys.getrefcount(probe.exporter)


_UNVIEWED = _unviewed_count()

__all__ = ["ARENA_MIN", "PAGE", "Arena", "Region", "available_memory"]
