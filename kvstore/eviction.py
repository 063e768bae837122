"""Capacity bookkeeping for byte-bounded backends: which object to drop next.

Owns: the `Evictor` protocol the memory and disk backends consult, and its default
`LRUEvictor`.  Must not touch: I/O.  The policy engine supplies other evictors through
the same protocol (`kvstore.policy`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class Evictor(Protocol):
    """Tracks resident objects; the backend asks it for victims when over budget."""

    def insert(self, name: str, size: int) -> None: ...
    def touch(self, name: str) -> None: ...
    def remove(self, name: str) -> None: ...
    def victim(self, protected: frozenset[str] | set[str] = frozenset()) -> str | None: ...


class LRUEvictor:
    """Least recently used first; `touch` on every hit, `insert` on every write."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, name: str, size: int) -> None:
        self._order[name] = size
        self._order.move_to_end(name)

    def touch(self, name: str) -> None:
        if name in self._order:
            self._order.move_to_end(name)

    def remove(self, name: str) -> None:
        self._order.pop(name, None)

    def victim(self, protected: frozenset[str] | set[str] = frozenset()) -> str | None:
        for name in self._order:
            if name not in protected:
                return name
        return None

    def __len__(self) -> int:
        return len(self._order)
