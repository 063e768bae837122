"""The parts every piece of a TieredStore shares, built once by `TieredStore`.

Owns: `Parts` (the tiers, the engine, the namespace book, metrics, the in-flight
registry, the guard, the buffer pool, the clock, the `on_gone` callback) and the
bookkeeping steps every piece repeats: forgetting a placement whose bytes never landed,
taking off the books names whose bytes a tier no longer has (a read found them gone, or
the backend evicted them to stay under its capacity), telling `on_gone` which names
left every tier, and refreshing gauges.  Must not touch: I/O (each piece does its own,
through `guard`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvstore.buffers import BufferPool
from kvstore.namespaces import NamespaceBook
from kvstore.policy import Placement
from kvstore.store_metrics import StoreMetrics
from kvstore.tier import Tier
from kvstore.tiered.guard import TierGuard
from kvstore.tiered.inflight import InFlight
from kvstore.tiered.stats import StoreCounters

log = logging.getLogger(__name__)


@dataclass
class Parts:
    tiers: list[Tier]
    labels: list[str]  # the tiers' metric labels (tier0, tier1, ...)
    placement: Placement
    book: NamespaceBook
    metrics: StoreMetrics
    inflight: InFlight
    guard: TierGuard
    pool: BufferPool
    clock: Callable[[], float]
    discover: bool
    counters: StoreCounters
    on_gone: Callable[[list[str]], None] | None = None  # told the names that left every tier
    # the books' seqlock (see `changing`): stretches under way, stretches ended
    _changing: int = field(default=0, init=False, repr=False)
    _changed: int = field(default=0, init=False, repr=False)

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Around a stretch of changes to the books whose middle a reader on another
        thread must not take for a state (a name placed before it is marked as being
        written; a failed write's mark cleared before the name is forgotten).  The
        loop's own tasks never see the middle of a synchronous stretch; another thread
        can, and `stamp` / `unchanged_since` tell it that it may have."""
        self._changing += 1
        try:
            yield
        finally:
            self._changed += 1
            self._changing -= 1

    def stamp(self) -> int | None:
        """For a reader on another thread, before it reads the books: None while a
        stretch of changes is under way (ask on the loop instead)."""
        changed = self._changed  # read before `_changing`: a stretch ending between is seen
        return None if self._changing else changed

    def unchanged_since(self, stamp: int) -> bool:
        """After the read: no stretch of changes began or ended since `stamp`."""
        return self._changing == 0 and self._changed == stamp  # `_changing` read first

    def forget(self, name: str, j: int) -> bool:
        """`name`'s bytes never landed in tier `j` (a failed write or copy): off the books.
        True if `name` is in no tier now."""
        with self.changing():
            self.placement.forget(name, j)
            if self.placement.where(name) is None:
                self.book.discard(name)
                return True
            return False

    def lost(self, j: int, names: Sequence[str]) -> None:
        """Tier `j` no longer has `names` (found gone by a read, or evicted by the backend
        to stay under its capacity): off the books there; `on_gone` hears of those that
        left every tier."""
        gone = [n for n in names if n in self.placement.tiers[j].resident and self.forget(n, j)]
        self.gone(gone)

    def evicted(self, j: int, names: list[str]) -> None:
        """Tier `j`'s backend evicted `names` (its `on_evict`): counted, then `lost`."""
        held = [n for n in names if n in self.placement.tiers[j].resident]
        if held:
            self.metrics.evictions.labels(self.labels[j]).inc(len(held))
            self.lost(j, held)
            self.update_gauges()

    def gone(self, names: list[str]) -> None:
        """Tell `on_gone` that `names` left every tier."""
        if names and self.on_gone is not None:
            try:
                self.on_gone(names)
            except Exception:
                log.exception("kvstore: on_gone callback failed")

    def update_gauges(self) -> None:
        for label, st in zip(self.labels, self.placement.tiers):
            self.metrics.tier_bytes.labels(label).set(st.used)
            self.metrics.tier_objects.labels(label).set(len(st.resident))
        for ns in self.book.namespaces():
            self.metrics.namespace_bytes.labels(ns).set(self.book.used.get(ns, 0))
