"""The peers' policies, for comparison: LRU, LFU, ARC and W-TinyLFU, byte-aware.

Owns: textbook versions of each, sized in bytes.  Must not touch: I/O, prefix chains
(these policies ignore `ChunkMeta`; that is the point of comparing against them).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container

from kvstore.policy.base import NO_META, NOTHING, ChunkMeta, Policy, lazy_heap_top


def _first_unprotected(order: OrderedDict[str, int], protected: Container[str]) -> str | None:
    for key in order:
        if key not in protected:
            return key
    return None


class LRUPolicy(Policy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str, evicted: bool = False) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        return _first_unprotected(self._order, protected)

    def order(self) -> list[str]:
        """Residents, next victim first."""
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy(Policy):
    """Least frequently used first (references while resident), ties broken by age."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: dict[str, int] = {}
        self._stamp: dict[str, int] = {}
        self._heap: list[tuple[int, int, str]] = []
        self._tick = 0

    def _push(self, key: str) -> None:
        self._tick += 1
        self._stamp[key] = self._tick
        heapq.heappush(self._heap, (self._freq[key], self._tick, key))

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._push(key)

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        if key in self._freq:
            self._freq[key] += 1
            self._push(key)

    def remove(self, key: str, evicted: bool = False) -> None:
        self._freq.pop(key, None)
        self._stamp.pop(key, None)

    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        top = lazy_heap_top(self._heap, lambda e: self._stamp.get(e[2]) == e[1], protected)
        found = None if top is None else top[2]
        if len(self._heap) > 4 * len(self._stamp) + 64:
            self._heap = [(self._freq[k], s, k) for k, s in self._stamp.items()]
            heapq.heapify(self._heap)
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._stamp

    def __len__(self) -> int:
        return len(self._stamp)


class ARCPolicy(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha), with the target `p` kept in bytes.

    T1 holds keys seen once recently, T2 keys seen at least twice; the ghost lists B1/B2
    remember recent victims of each and move `p` toward whichever would have hit.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[str, int] = OrderedDict()
        self.t2: OrderedDict[str, int] = OrderedDict()
        self.b1: OrderedDict[str, int] = OrderedDict()
        self.b2: OrderedDict[str, int] = OrderedDict()
        self.bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.p = 0.0
        self._ghost_hit: str | None = None  # "b1"/"b2" for the key being inserted
        self._pending: str | None = None

    def _pop(self, lst: str, key: str) -> int | None:
        size = getattr(self, lst).pop(key, None)
        if size is not None:
            self.bytes[lst] -= size
        return size

    def _put(self, lst: str, key: str, size: int) -> None:
        getattr(self, lst)[key] = size
        self.bytes[lst] += size

    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:
        b = self.bytes
        self._pending, self._ghost_hit = key, None
        if key in self.b1:
            size = self.b1[key]
            self.p = min(float(self.capacity), self.p + max(b["b2"] / max(b["b1"], 1), 1.0) * size)
            self._ghost_hit = "b1"
        elif key in self.b2:
            size = self.b2[key]
            self.p = max(0.0, self.p - max(b["b1"] / max(b["b2"], 1), 1.0) * size)
            self._ghost_hit = "b2"

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        ghost = self._ghost_hit if self._pending == key else None
        for lst in ("t1", "t2", "b1", "b2"):
            self._pop(lst, key)
        self._put("t2" if ghost else "t1", key, size)
        self._pending = self._ghost_hit = None
        self._trim_ghosts()

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        size = self._pop("t1", key)
        if size is None:
            size = self._pop("t2", key)
        if size is not None:
            self._put("t2", key, size)

    def remove(self, key: str, evicted: bool = False) -> None:
        for lst, ghost in (("t1", "b1"), ("t2", "b2")):
            size = self._pop(lst, key)
            if size is not None:
                if evicted:
                    self._put(ghost, key, size)
                    self._trim_ghosts()
                return

    def _trim_ghosts(self) -> None:
        b = self.bytes
        while b["t1"] + b["b1"] > self.capacity and self.b1:
            self._pop("b1", next(iter(self.b1)))
        while b["t1"] + b["t2"] + b["b1"] + b["b2"] > 2 * self.capacity and self.b2:
            self._pop("b2", next(iter(self.b2)))

    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        t1_first = self.t1 and (
            self.bytes["t1"] > self.p or (self._ghost_hit == "b2" and self.bytes["t1"] >= self.p)
        )
        lists = (self.t1, self.t2) if t1_first else (self.t2, self.t1)
        for lst in lists:
            key = _first_unprotected(lst, protected)
            if key is not None:
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class WTinyLFUPolicy(Policy):
    """W-TinyLFU (Einziger et al., Caffeine): a 1% LRU window in front of a segmented LRU
    main cache (20% probation, 80% protected); a window victim enters the main cache only
    if its estimated frequency beats the main cache's victim.  Frequencies are exact counts,
    halved whenever the number of recorded references reaches ten times the residents.
    """

    name = "wtinylfu"
    WINDOW = 0.01
    PROTECTED = 0.8

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.window: OrderedDict[str, int] = OrderedDict()
        self.probation: OrderedDict[str, int] = OrderedDict()
        self.protected: OrderedDict[str, int] = OrderedDict()
        self.window_bytes = 0
        self.protected_bytes = 0
        self.freq: dict[str, int] = {}
        self._events = 0
        self._candidates: OrderedDict[str, None] = OrderedDict()

    def _record(self, key: str) -> None:
        self.freq[key] = self.freq.get(key, 0) + 1
        self._events += 1
        if self._events >= 10 * max(len(self), 64):
            self._events //= 2
            self.freq = {k: v // 2 for k, v in self.freq.items() if v > 1}

    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._record(key)

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        self.remove(key)
        self.window[key] = size
        self.window_bytes += size
        # the window's overflow moves to probation, where it must win its place (`victim`)
        while self.window_bytes > self.WINDOW * self.capacity and len(self.window) > 1:
            k, s = self.window.popitem(last=False)
            self.window_bytes -= s
            self.probation[k] = s
            self._candidates[k] = None
            if len(self._candidates) > 64:
                self._candidates.popitem(last=False)

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._record(key)
        if key in self.window:
            self.window.move_to_end(key)
        elif key in self.protected:
            self.protected.move_to_end(key)
        elif key in self.probation:
            self._candidates.pop(key, None)
            size = self.probation.pop(key)
            self.protected[key] = size
            self.protected_bytes += size
            while self.protected_bytes > self.PROTECTED * self.capacity and len(self.protected) > 1:
                k, s = self.protected.popitem(last=False)
                self.protected_bytes -= s
                self.probation[k] = s

    def remove(self, key: str, evicted: bool = False) -> None:
        if key in self.window:
            self.window_bytes -= self.window.pop(key)
        elif key in self.protected:
            self.protected_bytes -= self.protected.pop(key)
        else:
            self.probation.pop(key, None)
            self._candidates.pop(key, None)

    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        """TinyLFU admission: the newest window overflow stays only if it is more frequent
        than the main cache's victim.  When it loses but was stored by the write now
        making room (`own`) there is no victim: that write is declined instead, so a
        prompt keeps its first chunks.  A protected newcomer of another write (pinned,
        read, being written) is passed over, and faces the test later."""
        vic = _first_unprotected(self.probation, protected)
        cand = None
        gone = []
        for k in reversed(self._candidates):
            if k not in self.probation:
                gone.append(k)
            elif k not in protected or k in own:
                cand = k
                break  # (a protected one, read or being written, stays a candidate for later)
        for k in gone:
            self._candidates.pop(k)
        if vic is None:
            return _first_unprotected(self.protected, protected) or _first_unprotected(self.window, protected)
        if cand is None or cand == vic:
            return vic
        if self.freq.get(cand, 0) > self.freq.get(vic, 0):
            return vic
        if cand in own:
            return None
        self._candidates.pop(cand)
        return cand

    def __contains__(self, key: object) -> bool:
        return key in self.window or key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)
