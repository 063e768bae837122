"""Belady's offline optimum (MIN with bypass): a reference limit, never a live policy.

Owns: `BeladyPolicy`, which is told the whole future reference sequence up front and
evicts the resident key whose next reference is farthest away; a key is not admitted
when it is never referenced again, or (when full) later than every resident's next use.  Must not touch: I/O.  It counts `touch`/`miss` calls to know
where in the sequence it is, so it is only valid where every reference reaches it
exactly once (the single-tier simulator).
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence

from kvstore.policy.base import NO_META, NOTHING, ChunkMeta, Policy, lazy_heap_top

NEVER = float("inf")


class BeladyPolicy(Policy):
    name = "belady"
    offline = True

    def __init__(self, capacity: int, future: Sequence[str] = ()) -> None:
        super().__init__(capacity)
        nxt: list[float] = [NEVER] * len(future)
        last: dict[str, int] = {}
        for i in range(len(future) - 1, -1, -1):
            k = future[i]
            nxt[i] = last.get(k, NEVER)
            last[k] = i
        self._future = future
        self._next = nxt
        self._pos = -1
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._sizes: dict[str, int] = {}
        self._used = 0

    def _advance(self, key: str) -> None:
        self._pos += 1
        if self._pos >= len(self._future) or self._future[self._pos] != key:
            raise RuntimeError("belady: the references differ from the future it was given")

    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._advance(key)

    def admit(self, key: str, size: int, meta: ChunkMeta = NO_META) -> bool:
        due = self._next[self._pos]
        if due == NEVER:
            return False
        if self._used + size <= self.capacity:
            return True
        # full: worth a place only if needed sooner than the farthest resident
        far = self.victim()
        return far is not None and self._due[far] > due

    def _set(self, key: str) -> None:
        due = self._next[self._pos]
        self._due[key] = due
        heapq.heappush(self._heap, (-due, key))

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        self.remove(key)
        self._sizes[key] = size
        self._used += size
        self._set(key)

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._advance(key)
        if key in self._due:
            self._set(key)

    def remove(self, key: str, evicted: bool = False) -> None:
        self._due.pop(key, None)
        self._used -= self._sizes.pop(key, 0)

    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        top = lazy_heap_top(self._heap, lambda e: self._due.get(e[1]) == -e[0], protected)
        return None if top is None else top[1]

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)
