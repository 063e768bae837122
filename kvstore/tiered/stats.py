"""What a TieredStore reports: per-tier and store-wide snapshots, and its own counters.

Owns: `TierStats`, `StoreStats` (the values `TieredStore.stats()` returns) and
`StoreCounters` (what the store itself counts; each tier counts its own reads in
`kvstore.tier.TierCounters`).  Must not touch: anything live; these are plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.backends.base import BackendStats


@dataclass
class TierStats:
    name: str
    policy: str
    capacity: int | None
    used_bytes: int
    objects: int
    hits: int
    bytes_read: int
    writes: int
    evictions: int
    promotions_in: int
    demotions_in: int
    rejected: int
    backend: BackendStats


@dataclass
class StoreStats:
    tiers: list[TierStats]
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)
    moves_in_flight: int = 0
    pinned: int = 0
    declined: int = 0  # reads the caller skipped, or whose buffer did not fit the frame
    discovered: int = 0  # objects found in a tier the engine did not know of, and adopted
    found: int = 0  # lookups that found an object the engine did not know of (not yet read)


@dataclass(slots=True)
class StoreCounters:
    discovered: int = 0
    found: int = 0
