"""Trace replay through modelled tiers, with the same policy objects the live store uses.

Owns: `TierModel` (a modelled tier: capacity, policy, bandwidth), `simulate()` and its
`SimResult`.  Must not touch: backends, asyncio.

Per request: the longest prefix of its blocks held in any tier counts as hits (each hit
is read from the tier that holds it, promoted to the top tier when lower), then every
block after that prefix is stored (a block already held somewhere is touched), as one
write batch (`WriteBatch`: no tier evicts its blocks for its later ones).  `kvstore.tiered`
runs the same `Placement` calls for `prefix_lookup` / `get_many` / `put_many`, so a live
replay reproduces these hit counts exactly.

``parents=False`` withholds each block's place in its prefix chain: every block is
stored with no metadata (no parent, depth 0, not a tail), as ``put_many(...,
chained=False)`` stores it — what the store sees when it cannot tell a chunk's
predecessor (e.g. rolling-hash keys with no preceding lookup).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvstore.policy import DEFAULT_POLICY, ChunkMeta, make_policy
from kvstore.policy.base import NO_META
from kvstore.policy.engine import Placement, TierState, WriteBatch, WriteMode
from kvstore.policy.trace import BLOCK_TOKENS, Request, distinct_blocks

GB = 1e9


@dataclass
class TierModel:
    """A modelled tier.  `bandwidth` (bytes/s) turns bytes read into load time."""

    capacity: int
    policy: str = DEFAULT_POLICY
    name: str = ""
    bandwidth: float = 10 * GB
    write: WriteMode = "back"
    high: float = 1.0
    low: float = 1.0


@dataclass
class TierResult:
    name: str
    policy: str
    capacity: int
    hits: int
    hit_ratio: float
    bytes_read: int
    bytes_written: int
    writes: int
    evictions: int
    promotions_in: int
    demotions_in: int
    rejected: int
    load_seconds: float


@dataclass
class SimResult:
    policy: str
    capacity_blocks: int
    requests: int
    block_refs: int
    distinct_blocks: int
    prefix_hits: int
    hit_ratio: float
    block_bytes: int
    tiers: list[TierResult] = field(default_factory=list)
    load_seconds: float = 0.0
    recompute_seconds_saved: float = 0.0
    recompute_seconds_total: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def block_keys(r: Request) -> list[str]:
    """The engine's keys (object names are strings) for a request's block ids."""
    return [str(b) for b in r.hash_ids]


def chain_meta(keys: Sequence[str], i: int) -> ChunkMeta:
    """Metadata of the i-th block of a request: its depth and its parent in the chain."""
    return ChunkMeta(depth=i, parent=keys[i - 1] if i else None, tail=i == len(keys) - 1)


def build_placement(
    tiers: list[TierModel], requests: list[Request] | None = None, promote: bool = True
) -> Placement:
    states = []
    for i, t in enumerate(tiers):
        kwargs: dict = {}
        if t.policy == "belady":
            if len(tiers) != 1 or requests is None:
                raise ValueError("belady is an offline reference for one tier only")
            kwargs["future"] = [k for r in requests for k in block_keys(r)]
        states.append(
            TierState(
                capacity=t.capacity,
                policy=make_policy(t.policy, t.capacity, **kwargs),
                name=t.name or f"tier{i}",
                write=t.write,
                high=t.high,
                low=t.low,
            )
        )
    return Placement(states, promote=promote)


def replay(placement: Placement, requests: list[Request], block_bytes: int = 1, parents: bool = True) -> int:
    """Run `requests` through `placement`; the number of prefix-hit blocks.

    parents: tell the policies each stored block's chain position (`chain_meta`); False
    stores every block with `NO_META`, as an unchained ``put_many``.
    """
    hits = 0
    prefix = placement.prefix
    hit = placement.hit
    store = placement.store
    for r in requests:
        keys = block_keys(r)
        n = prefix(keys)
        hits += n
        for i in range(n):
            hit(keys[i])  # as a live read: the policy knows the chunk from when it was stored
        batch = WriteBatch()  # as a live `put_many`: the request's blocks are one write
        for i in range(n, len(keys)):
            store(keys[i], block_bytes, chain_meta(keys, i) if parents else NO_META, batch=batch)
    return hits


def simulate(
    requests: list[Request],
    tiers: list[TierModel],
    block_bytes: int = 1,
    prefill_tokens_per_s: float = 10_000.0,
    block_tokens: int = BLOCK_TOKENS,
    parents: bool = True,
) -> SimResult:
    """Replay `requests` through `tiers` (capacities in bytes; blocks are `block_bytes` each)."""
    placement = build_placement(tiers, requests)
    hits = replay(placement, requests, block_bytes, parents)
    refs = sum(len(r.hash_ids) for r in requests)
    out_tiers = []
    load = 0.0
    for model, st in zip(tiers, placement.tiers):
        c = st.counters
        secs = c.bytes_read / model.bandwidth if model.bandwidth else 0.0
        load += secs
        out_tiers.append(
            TierResult(
                name=st.name,
                policy=model.policy,
                capacity=model.capacity,
                hits=c.hits,
                hit_ratio=c.hits / refs if refs else 0.0,
                bytes_read=c.bytes_read,
                bytes_written=c.bytes_written,
                writes=c.writes,
                evictions=c.evictions,
                promotions_in=c.promotions_in,
                demotions_in=c.demotions_in,
                rejected=c.rejected,
                load_seconds=secs,
            )
        )
    return SimResult(
        policy=tiers[0].policy,
        capacity_blocks=tiers[0].capacity // block_bytes,
        requests=len(requests),
        block_refs=refs,
        distinct_blocks=distinct_blocks(requests),
        prefix_hits=hits,
        hit_ratio=hits / refs if refs else 0.0,
        block_bytes=block_bytes,
        tiers=out_tiers,
        load_seconds=load,
        recompute_seconds_saved=hits * block_tokens / prefill_tokens_per_s,
        recompute_seconds_total=refs * block_tokens / prefill_tokens_per_s,
    )


def single_tier(
    requests: list[Request], fraction: float, policy: str = DEFAULT_POLICY, parents: bool = True
) -> SimResult:
    """The fixed benchmark: one tier holding `fraction` × distinct blocks, equal-size blocks."""
    cap = int(fraction * distinct_blocks(requests))
    return simulate(
        requests, [TierModel(capacity=cap, policy=policy, name="tier0")], block_bytes=1, parents=parents
    )
