"""The policy interface: what every placement policy answers, from metadata alone.

Owns: `ChunkMeta` (what a policy may know about a chunk) and the `Policy` ABC.  Must not
touch: I/O, clocks, asyncio — a policy is pure and synchronous, so the live store and the
simulator run the same code.

Call protocol (one tier; `kvstore.policy.engine` drives it):

* every reference to a key calls exactly one of ``touch(key, meta)`` (resident: a hit)
  or ``miss(key, meta)`` (not resident; feeds ghost lists and frequency sketches);
* after a miss the engine may ask ``admit(key, size, meta)`` and then ``insert``;
* when over budget it asks ``victim(protected)`` and then ``remove(key, evicted=True)``;
  ``remove(key)`` without `evicted` is a delete (no ghost entry, no learning).

`victim` must never return a key in `protected` (pinned, being read, or stored earlier
in the same write batch); it returns None when every resident key is protected.
Chain-aware policies return only leaves (chunks with no resident child), so for them
None also means every leaf is protected: evicting a protected chunk's ancestor would
strand it.
"""

from __future__ import annotations

import abc
import heapq
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

NOTHING: frozenset[str] = frozenset()


class AnyOf(Container[str]):
    """Membership in either of two containers, without building their union (the live
    in-flight registry and a write batch's names, as one `protected`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


def lazy_heap_top(
    heap: list[tuple[Any, ...]], live: Callable[[tuple[Any, ...]], bool], protected: Container[Hashable]
) -> tuple[Any, ...] | None:
    """The smallest live entry of a lazily-deleted heap whose key (its last element) is
    not protected.  Stale entries (``live(entry)`` false) are dropped for good; protected
    ones are set aside and pushed back, so the heap is otherwise unchanged."""
    held = []
    found = None
    while heap:
        top = heap[0]
        if not live(top):
            heapq.heappop(heap)
        elif top[-1] in protected:
            held.append(heapq.heappop(heap))
        else:
            found = top
            break
    for entry in held:
        heapq.heappush(heap, entry)
    return found


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a policy may know about a chunk besides its name and size.

    depth: position in its prefix chain (0 = first chunk of a prompt).
    parent: name of the chunk before it in the chain (None for a head or unknown);
        a chunk is only useful while its parent is, so chain-aware policies evict tails first.
    cost: relative cost of recomputing it (prefill work); 1.0 when unknown.
    tail: it was the last chunk of the batch that stored it (the end of a prompt, often a
        partial block that later prompts do not share).
    """

    depth: int = 0
    parent: str | None = None
    cost: float = 1.0
    tail: bool = False


NO_META = ChunkMeta()


class Policy(abc.ABC):
    """Orders the residents of one tier for eviction and decides admission."""

    name: ClassVar[str] = ""
    #: True for offline policies that need the future (`belady`); never a default.
    offline: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def admit(self, key: str, size: int, meta: ChunkMeta = NO_META) -> bool:
        """Whether a key that just missed should be stored at all (default: always)."""
        return True

    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:  # noqa: B027 - optional hook
        """A reference to a key that is not resident."""

    @abc.abstractmethod
    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        """`key` is now resident (after a miss, or re-written)."""

    @abc.abstractmethod
    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        """A hit on a resident key."""

    @abc.abstractmethod
    def remove(self, key: str, evicted: bool = False) -> None:
        """`key` left the tier: chosen victim (`evicted`) or deleted.  Unknown keys are ignored."""

    @abc.abstractmethod
    def victim(self, protected: Container[str] = NOTHING, own: Container[str] = NOTHING) -> str | None:
        """The resident key to drop next, never one in `protected`; None if there is none.

        own: the keys the write now making room stored before (all in `protected` too). A
        policy that declines a newcomer by evicting it (W-TinyLFU) declines the write
        instead (None) when that newcomer is one of them; the others ignore it.
        """

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...
