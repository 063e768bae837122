"""The parts every piece of a TieredStore shares, built once by `TieredStore`.

Owns: `Parts` (the tiers, the engine, the namespace book, metrics, the in-flight
registry, the guard, the buffer pool, the clock) and the two bookkeeping steps every
piece repeats: forgetting a placement whose bytes never landed, and refreshing gauges.
Must not touch: I/O (each piece does its own, through `guard`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.buffers import BufferPool
from kvstore.namespaces import NamespaceBook
from kvstore.policy import Placement
from kvstore.store_metrics import StoreMetrics
from kvstore.tier import Tier
from kvstore.tiered.guard import TierGuard
from kvstore.tiered.inflight import InFlight
from kvstore.tiered.stats import StoreCounters


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

    def forget(self, name: str, j: int) -> None:
        """`name`'s bytes never landed in tier `j` (a failed write or copy): off the books."""
        self.placement.forget(name, j)
        if self.placement.where(name) is None:
            self.book.discard(name)

    def update_gauges(self) -> None:
        for label, st in zip(self.labels, self.placement.tiers):
            self.metrics.tier_bytes.labels(label).set(st.used)
            self.metrics.tier_objects.labels(label).set(len(st.resident))
        for ns in self.book.namespaces():
            self.metrics.namespace_bytes.labels(ns).set(self.book.used.get(ns, 0))
