"""The policy engine: pure, synchronous placement decisions for the tiered store and the simulator.

Owns: the policy registry.  Policies (all byte-aware, all behind `Policy`):

=========  ==============================================================
``chain``  default; prefix-chain aware, adaptive (see `kvstore.policy.chain`)
``reuse``  hit density by age, learned per class, with admission (`kvstore.policy.reuse`)
``lru``    least recently used
``lfu``    least frequently used
``arc``    Adaptive Replacement Cache
``wtinylfu`` W-TinyLFU (window LRU + TinyLFU admission + segmented LRU)
``belady`` offline optimum; needs the future, simulator only
=========  ==============================================================

`make_policy(name, capacity)` builds one.  Multi-tier rules live in `kvstore.policy.engine`.
A policy decides placement inside one process (what a store demotes or drops); the hard
bound of a tier's medium is its backend's own least-recently-used eviction (see
`kvstore.tier_options`).  Must not touch: I/O, asyncio, clocks.
"""

from __future__ import annotations

from typing import Any

from kvstore.policy.base import NO_META, AnyOf, ChunkMeta, Policy
from kvstore.policy.belady import BeladyPolicy
from kvstore.policy.chain import ChainPolicy
from kvstore.policy.classic import ARCPolicy, LFUPolicy, LRUPolicy, WTinyLFUPolicy
from kvstore.policy.engine import (
    Copy,
    Drop,
    Move,
    Placement,
    PlacementCounters,
    TierState,
    Write,
    WriteBatch,
    WriteMode,
)
from kvstore.policy.reuse import ReusePolicy

DEFAULT_POLICY = "chain"

POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (ChainPolicy, ReusePolicy, LRUPolicy, LFUPolicy, ARCPolicy, WTinyLFUPolicy, BeladyPolicy)
}
ONLINE_POLICIES = tuple(n for n, p in POLICIES.items() if not p.offline)


def make_policy(name: str, capacity: int, **kwargs: Any) -> Policy:
    """A fresh policy by name; `belady` also needs ``future=`` (the reference sequence)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(capacity, **kwargs)


__all__ = [
    "DEFAULT_POLICY",
    "NO_META",
    "ONLINE_POLICIES",
    "POLICIES",
    "AnyOf",
    "ChunkMeta",
    "Copy",
    "Drop",
    "Move",
    "Placement",
    "PlacementCounters",
    "Policy",
    "TierState",
    "Write",
    "WriteBatch",
    "WriteMode",
    "make_policy",
]
