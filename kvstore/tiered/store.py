"""`TieredStore`: the public API, composing tiers, the policy engine and the store's parts.

Owns: building a store (from `TierSpec`s or tier URLs), the public calls and their order
of steps (expire, then decide and carry out), namespaces' expiry, pins, stats and
closing.  Each step is done by one part: `lookup` (visibility, discovery, prefix
lookup), `reads` (get paths), `writes` (put path), `moves` (the engine's drops and
copies), `inflight` (what is under way), `guard` (per-tier deadline and breaker).  Must
not touch: placement rules (the engine decides), tensor ↔ frame work (`Tier`), backend
internals.  See `kvstore.tiered` for the API and its guarantees.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.backends.breaker import CircuitBreaker
from kvstore.buffers import BufferPool
from kvstore.namespaces import NO_RULE, NamespaceBook, NamespaceRule, namespace_of
from kvstore.policy import DEFAULT_POLICY, Move, Placement
from kvstore.store_metrics import StoreMetrics
from kvstore.tier import Tier
from kvstore.tier_stream import Out, Target
from kvstore.tiered.direct import DirectReads, Done
from kvstore.tiered.guard import TierGuard
from kvstore.tiered.inflight import InFlight
from kvstore.tiered.lookup import Lookup
from kvstore.tiered.moves import Mover
from kvstore.tiered.parts import Parts
from kvstore.tiered.reads import Reader
from kvstore.tiered.spec import TierSpec, placement_for, specs_from
from kvstore.tiered.stats import StoreCounters, StoreStats, TierStats
from kvstore.tiered.writes import Writer

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


class TieredStore:
    """Tensors across tiers; see `kvstore.tiered` for the API and guarantees."""

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        namespaces: dict[str, NamespaceRule] | None = None,
        default_namespace: NamespaceRule = NO_RULE,
        max_moves: int = 4,
        pin_ttl: float = 60.0,
        promote: bool = True,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        discover: bool = False,
        pool: BufferPool | None = None,
        tier_timeout: float | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        if max_moves < 1:
            raise ValueError("max_moves must be at least 1")
        self.specs = list(tiers)
        self.tiers = [s.tier for s in self.specs]
        self.placement: Placement = placement_for(self.specs, promote)
        self.tier_names = [st.name for st in self.placement.tiers]
        self.book = NamespaceBook(namespaces, default_namespace)
        self.metrics = StoreMetrics(registry)
        self.pin_ttl = pin_ttl
        self.pool = pool if pool is not None else BufferPool()
        self.discover = discover
        self.tier_timeout = tier_timeout
        self._clock = clock
        self._closed = False
        self.inflight = InFlight(clock)
        self.guard = TierGuard(self.tiers, self.tier_names, self.metrics, tier_timeout)
        self.counters = StoreCounters()
        self.parts = parts = Parts(
            tiers=self.tiers,
            labels=self.tier_names,
            placement=self.placement,
            book=self.book,
            metrics=self.metrics,
            inflight=self.inflight,
            guard=self.guard,
            pool=self.pool,
            clock=clock,
            discover=discover,
            counters=self.counters,
        )
        for j, tier in enumerate(self.tiers):
            # the backend's own eviction (its capacity, the medium's hard bound) leaves our books
            tier.backend.on_evict = partial(parts.evicted, j)
        self.mover = Mover(parts, max_moves)
        self.lookup = Lookup(parts, self.mover.deleting)
        self.reader = Reader(parts, self.lookup, self.mover)
        self.direct = DirectReads(parts, self.lookup, self.reader, self.mover)
        self.reader.settle_first = self.direct.settle_pending
        self.writer = Writer(parts, self.mover)

    @classmethod
    def from_urls(
        cls,
        specs: Sequence[str | tuple[str, str] | TierSpec],
        *,
        policy: str = DEFAULT_POLICY,
        **kwargs: Any,
    ) -> TieredStore:
        """A store from tier URLs, hot first: ``"mem://hot?capacity=1GiB"``, ``("s3://b/p", "cachegen")``."""
        return cls(specs_from(specs, policy), **kwargs)

    # -- the parts' public faces -------------------------------------------------------
    @property
    def breakers(self) -> list[CircuitBreaker]:
        """Each tier's breaker (see `kvstore.tiered.guard`)."""
        return self.guard.breakers

    @property
    def max_moves(self) -> int:
        return self.mover.max_moves

    @property
    def on_gone(self) -> Callable[[list[str]], None] | None:
        """Called with the names that left every tier (evicted by the engine or a backend,
        found gone by a read, or deleted)."""
        return self.parts.on_gone

    @on_gone.setter
    def on_gone(self, callback: Callable[[list[str]], None] | None) -> None:
        self.parts.on_gone = callback

    def tier_available(self, j: int) -> bool:
        """Is tier `j`'s breaker closed (calls go through)?"""
        return self.guard.available(j)

    async def warm_up(self, timeout: float = 10.0) -> None:
        """Touch every tier once (connections, clients, lazy indexes, worker threads)
        outside any serving deadline, so a first request does not pay for it and trip a
        breaker.  A tier that cannot answer is logged, not raised: it fails fast later."""

        async def touch(tier: Tier) -> None:
            try:
                await asyncio.wait_for(tier.backend.check(), timeout)
                await asyncio.wait_for(tier.contains_many(["kvstore/warm-up/probe"]), timeout)
            except Exception as exc:
                log.warning("kvstore: %s did not answer at start: %s", tier.name, exc)

        await asyncio.gather(*(touch(t) for t in self.tiers))

    # -- lookups -------------------------------------------------------------------------
    async def prefix_lookup(self, names: Sequence[str]) -> int:
        """How many leading `names` are held in some tier."""
        now = self._clock()
        await self._catch_up(now)
        return await self.lookup.prefix(names, now)

    def known_prefix(self, names: Sequence[str]) -> int | None:
        """`prefix_lookup` answered without this store's event loop, so a caller on
        another thread need not wait for it (a hop there and back is ~0.1 ms on a 2-core
        machine, the whole of a hit's lookup).  It reads the engine's books (a read that
        overlapped a stretch of the loop's changes answers None: `Parts.changing`; an
        answer may still be stale by the read, as any lookup's is) and, with discovery,
        asks each tier's
        `Backend.contains_now` about the first name the books do not serve (a `stat` on
        disk).  None when that is not enough: a tier holds the name (another process
        stored it; it is adopted on the loop) or cannot say at once; ask
        `prefix_lookup` then."""
        if self._closed:
            return None
        return self.lookup.known_prefix(names, self._clock())

    def lookup_now(self, names: Sequence[str], ttl: float | None = None) -> list[bool] | None:
        """`contains_many`, then `pin` of the names found, answered on the caller's
        thread without this store's event loop (a hop there and back is most of a
        lookup's time); None when that cannot be done (see `Lookup.known`): run
        `contains_many` and `pin` on the loop then.

        The found names are pinned first and the books read again after: the loop
        chooses victims (writes, promotions on a hit, adoptions) and takes names off the
        books (deletes, expiry, a tier's own evictions) inside `Parts.changing`
        stretches, so a victim chosen after the pin sees it, and one chosen before it is
        off the books by the second read (or that read overlaps the stretch and answers
        None).  On None the pins stay until
        they expire or are unpinned (a pin is a name's, not a caller's: one taken here
        may be another lookup's too)."""
        if self._closed:
            return None
        now = self._clock()
        found = self.lookup.known(names, now)
        if found is None:
            return None
        held = [n for n, f in zip(names, found) if f]
        if held:
            self.pin(held, ttl)
            again = self.lookup.known(held, now)
            if again is None or not all(again):
                return None
        return found

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        now = self._clock()
        await self._catch_up(now)
        return await self.lookup.contains(names, now)

    # -- writes and reads ----------------------------------------------------------------
    async def put_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        chained: bool = False,
        parent: str | None = None,
        layout: str = "raw",
    ) -> list[bool]:
        """Store tensors; see `kvstore.tiered`."""
        now = self._clock()
        await self._catch_up(now)
        return await self.writer.put_many(items, chained=chained, parent=parent, layout=layout, now=now)

    async def get_many(self, names: Sequence[str], out: Sequence[Out] | None = None) -> list[torch.Tensor | None]:
        """Tensors for `names` (None = miss); see `kvstore.tiered` for `out`."""
        now = self._clock()
        await self._catch_up(now)
        return await self.reader.get_many(names, out, now)

    def read_now(
        self, names: Sequence[str], outs: Sequence[Target], done: Done, loop: asyncio.AbstractEventLoop
    ) -> bool:
        """`get_many` of `names` into `outs` (a tensor or a `ByteTarget` each) without
        this store's event loop (`loop`) on the way: from any thread, the reads start on
        worker threads at once, and `done` is called from one of them with the payload
        sizes once every object is in its target, verified, or with None once nothing
        more is written into the targets and the batch needs `get_many` (a miss, a
        defect, anything but a clean hit).  False: not started (the names are not all on
        one tier that can read off the loop, or the books were changing); call
        `get_many`.  See `kvstore.tiered.direct`."""
        if self._closed:
            return False
        return self.direct.start(names, outs, done, loop)

    # -- deletes, pins, expiry -----------------------------------------------------------
    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        """Remove from every tier; True where the name was held.

        With ``discover``, names the engine does not know (stored by another process or
        an earlier run) are deleted from every tier too, and count as held if a tier had them.
        """
        self.direct.settle_pending()  # (the books as they are)
        existed = []
        moves: list[Move] = []
        unknown: list[int] = []
        with self.parts.changing():
            for i, name in enumerate(names):
                existed.append(self.placement.where(name) is not None)
                if self.discover and not existed[-1] and self.lookup.unknown(name):  # (deleting it twice is harmless)
                    unknown.append(i)
                moves.extend(self.placement.delete(name))
                self.book.discard(name)
            drops = self.mover.begin(moves)
        await self.mover.finish(drops)
        if unknown:
            asked = [names[i] for i in unknown]
            for held in await self.mover.delete_each([(j, asked) for j in range(len(self.tiers))]):
                for i, h in zip(unknown, held):
                    existed[i] = existed[i] or h
        self.parts.update_gauges()
        return existed

    def pin(self, names: Sequence[str], ttl: float | None = None) -> None:
        """Keep `names` from eviction for `ttl` seconds (default `pin_ttl`) or until unpinned."""
        self.inflight.pin(names, self._clock() + (self.pin_ttl if ttl is None else ttl))

    def unpin(self, names: Sequence[str]) -> None:
        """Any thread may unpin (and pin): the pin table has a lock of its own."""
        self.inflight.unpin(names)

    async def _catch_up(self, now: float) -> None:
        """Before an operation on the loop: the hits of reads off the loop that have ended
        go on the books (an LRU victim chosen now sees them; a failed read's streak
        sees the clean reads before it), and what has expired leaves them."""
        self.direct.settle_pending()
        await self._expire(now)

    async def _expire(self, now: float) -> None:
        self.inflight.prune_pins(now)
        gone = self.book.expired(now)
        if not gone:
            return
        moves: list[Move] = []
        with self.parts.changing():
            for name in gone:
                moves.extend(self.placement.delete(name))
                self.book.discard(name)
                self.metrics.expired.labels(namespace_of(name)).inc()
            drops = self.mover.begin(moves)
        await self.mover.finish(drops)

    async def drain(self) -> None:
        """Wait until every background copy has finished (the hits of reads off the loop
        that have ended go on the books first: they may promote)."""
        self.direct.settle_pending()
        await self.mover.drain()

    # -- reporting -----------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """The store's counters.  On the loop they include every read that has ended;
        from another thread, reads off the loop of the last
        `kvstore.tiered.direct.SETTLE_S` may be missing."""
        self.direct.settle_pending()
        tiers = []
        for spec, st, tier in zip(self.specs, self.placement.tiers, self.tiers):
            c = st.counters
            tiers.append(
                TierStats(
                    name=st.name,
                    policy=st.policy.name,
                    capacity=spec.capacity,
                    used_bytes=st.used,
                    objects=len(st.resident),
                    hits=c.hits,
                    bytes_read=c.bytes_read,
                    writes=c.writes,
                    evictions=c.evictions,
                    promotions_in=c.promotions_in,
                    demotions_in=c.demotions_in,
                    rejected=c.rejected,
                    backend=tier.backend.stats(),
                )
            )
        return StoreStats(
            tiers=tiers,
            namespaces={
                ns: {"bytes": self.book.used.get(ns, 0), "objects": self.book.objects(ns)}
                for ns in self.book.namespaces()
            },
            moves_in_flight=len(self.mover.tasks),
            pinned=self.inflight.pinned(self._clock()),
            declined=sum(t.counters.declined for t in self.tiers),
            discovered=self.counters.discovered,
            found=self.counters.found,
        )

    async def close(self) -> None:
        """Finish background copies, then close every tier."""
        if self._closed:
            return
        self._closed = True
        await self.direct.close()  # (their bookkeeping may start promotions: before the drain)
        await self.drain()
        for tier in self.tiers:
            await tier.close()

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
