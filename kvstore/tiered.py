"""TieredStore: tensors by object name across ordered tiers (hot → cold), placed by policy.

Owns: carrying out the placement engine's decisions (`kvstore.policy.engine`) with real
tiers (`kvstore.tier.Tier` = backend + codec); in-flight bookkeeping; background copies
between tiers; namespaces (quota, TTL); metrics.  Must not touch: placement rules (the
engine decides, this module executes), frame or codec internals, backend internals.

Build one::

    store = TieredStore.from_urls(
        ["mem://hot?capacity=1GiB", "file:///var/kv?capacity=10GiB", ("s3://b/p", "cachegen")],
        policy="chain",                       # default; or lru, lfu, arc, wtinylfu
        namespaces={"tenant-a": NamespaceRule(quota=2 << 30, ttl=3600)},
    )

A tier spec is a URL, ``(url, codec)`` or a `TierSpec`.  Store options in the URL query
(``capacity``, ``policy``, ``write=back|through``, ``high``, ``low``) are taken out before
the backend is opened; the store, not the backend, enforces the byte budget.

API (all batched, all async except pin/unpin/stats):

* ``put_many([(name, tensor)], chained=False, parent=None) -> [bool]``  Store; True when
  the object is held (written now, or already held).  With ``chained=True`` the items are
  consecutive chunks of one prompt, in order, and `parent` names the chunk just before
  the first (the end of the prefix already cached): the policy then knows each chunk's
  place in its prefix chain.  A write becomes visible only once it has landed.
* ``put_many(..., layout="raw")``  `layout` tags the stored frame (e.g.
  ``"lmcache:KV_2LTD"``) and comes back in the header a reader sees.
* ``get_many(names, out=None) -> [tensor | None]``  Read from the highest tier holding
  each name; a hit in a lower tier is promoted in the background.  Defective frames are
  quarantined and read as misses.  ``out[i]`` may be a tensor to decode into, or a
  callable ``(FrameHeader) -> tensor | None`` called once the frame's header is read and
  checked, so the caller allocates exactly the stored shape (None: skip it, a miss
  that leaves the object stored; so is a tensor that does not fit).  With every
  ``out[i]`` given, a backend that streams (disk) reads a raw payload straight into the
  caller's tensor, hashing each block as it lands, and hands it back only if the
  checksum matches (the callable then runs on a backend worker thread: keep it
  thread-safe); other non-memory tiers read into pooled, reused buffers and decode into
  the caller's tensors.  Either way the payload is copied once.
* ``contains_many(names) -> [bool]``, ``delete_many(names) -> [bool existed]``.
* ``prefix_lookup(names) -> int``  How many leading names are held in some tier (the
  question LMCache asks before retrieving); changes no policy state.
* ``pin(names, ttl=None)`` / ``unpin(names)``  A pinned name is never evicted until
  unpinned or until its pin expires (`pin_ttl` seconds by default).
* ``drain()``  Wait for background copies (promotions, demotions).
* ``stats() -> StoreStats``; ``metrics.text()`` for Prometheus; ``close()``.

With ``discover=True`` (the LMCache plugins' setting) names the engine does not know are
looked up in the tiers themselves: a lookup asks the backends, a read tries each tier in
order, and an object found is adopted into the engine's books.  That is how a process
finds what another process (or an earlier run) stored in a shared disk, Redis or S3
tier, and how a name forgotten after a failed read (a server down for a moment) hits
again once the server is back.

Guarantees: a name being written is invisible until complete; a name being read, written
or pinned is never chosen as a victim; a victim is demoted to the next tier (if that tier
admits it) instead of dropped, and stays readable from its old tier until the copy has
landed; at most `max_moves` copies run at once.  Byte budgets count frame bytes; a
demotion into a tier with another codec is accounted at the source size.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.backends.base import BackendStats
from kvstore.backends.breaker import BreakerState, CircuitBreaker
from kvstore.buffers import BufferPool
from kvstore.codec.base import CodecUnavailableError
from kvstore.frame import FrameError, FrameHeader
from kvstore.keys import InvalidKeyError, check_object_name
from kvstore.namespaces import NO_RULE, NamespaceBook, NamespaceRule, namespace_of
from kvstore.options import parse_size
from kvstore.policy import DEFAULT_POLICY, NO_META, ChunkMeta, Move, Placement, TierState, make_policy
from kvstore.store_metrics import StoreMetrics
from kvstore.tier import Tier

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")

UNBOUNDED = sys.maxsize
Out = Union["torch.Tensor", Callable[[FrameHeader], "torch.Tensor | None"], None]
# outcome of reading one name from one tier
HIT, GONE, DECLINED, UNAVAILABLE = 0, 1, 2, 3  # UNAVAILABLE: the tier did not answer
STORE_OPTIONS = frozenset({"capacity", "policy", "write", "high", "low"})


@dataclass
class TierSpec:
    """One tier of a store: where (`tier`), how much (`capacity` bytes, None = unbounded),
    which policy, write mode ("back": filled by demotion; "through": every store lands
    here too) and watermarks (evict from above `high` × capacity down to `low` ×)."""

    tier: Tier
    capacity: int | None = None
    policy: str = DEFAULT_POLICY
    write: Literal["back", "through"] = "back"
    high: float = 1.0
    low: float = 1.0
    name: str = ""


def split_store_options(url: str) -> tuple[str, dict[str, str]]:
    """(`url` without the store's own query options, those options)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    mine = {k: v for k, v in query if k in STORE_OPTIONS}
    rest = [(k, v) for k, v in query if k not in STORE_OPTIONS]
    return urlunsplit(parts._replace(query=urlencode(rest))), mine


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


class _Protected:
    """Names no victim may be chosen from: those being read, and live pins."""

    __slots__ = ("store",)

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def __contains__(self, name: object) -> bool:
        s = self.store
        if name in s._reading:
            return True
        until = s._pins.get(name)  # type: ignore[arg-type]
        return until is not None and until > s._clock()


class TieredStore:
    """Tensors across tiers; see the module docstring for the API and guarantees."""

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
        states = []
        for i, s in enumerate(self.specs):
            cap = s.capacity if s.capacity else UNBOUNDED
            states.append(
                TierState(
                    capacity=cap,
                    policy=make_policy(s.policy, cap),
                    name=s.name or f"tier{i}",
                    write=s.write,
                    high=s.high,
                    low=s.low,
                )
            )
        if any(st.policy.offline for st in states):
            raise ValueError("belady needs the future; it runs only in `kvstore simulate`")
        self.placement = Placement(states, promote=promote)
        self.tier_names = [st.name for st in states]
        self.book = NamespaceBook(namespaces, default_namespace)
        self.metrics = StoreMetrics(registry)
        self.max_moves = max_moves
        self.pin_ttl = pin_ttl
        self._clock = clock
        self._writing: Counter[str] = Counter()
        self._reading: Counter[str] = Counter()
        self._pins: dict[str, float] = {}
        self._landing: dict[tuple[str, int], int] = {}  # (name, tier) -> tier its bytes are still in
        self._landed: dict[str, asyncio.Event] = {}  # name -> set when its foreground write is done
        self._copies: Counter[str] = Counter()  # copies spawned and not finished, per name
        self._name_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._sem: asyncio.Semaphore | None = None
        self._protected = _Protected(self)
        self._closed = False
        self.discover = discover
        self.pool = pool if pool is not None else BufferPool()
        self._pooled = [not s.tier.backend.url.startswith("mem:") for s in self.specs]
        self._declined = 0
        self._discovered = 0
        self._found = 0
        # called with the names that left every tier (evicted or deleted)
        self.on_gone: Callable[[list[str]], None] | None = None
        # per tier: a deadline on every call, and a breaker that fails fast after a miss
        self.tier_timeout = tier_timeout
        self.breakers = [
            CircuitBreaker(failure_threshold=1, reset_after=1.0, max_reset_after=30.0) for _ in self.tiers
        ]

    @classmethod
    def from_urls(
        cls,
        specs: Sequence[str | tuple[str, str] | TierSpec],
        *,
        policy: str = DEFAULT_POLICY,
        **kwargs: object,
    ) -> TieredStore:
        """A store from tier URLs, hot first: ``"mem://hot?capacity=1GiB"``, ``("s3://b/p", "cachegen")``."""
        tiers = []
        for i, spec in enumerate(specs):
            if isinstance(spec, TierSpec):
                tiers.append(spec)
                continue
            url, codec = (spec, "raw") if isinstance(spec, str) else spec
            backend_url, opts = split_store_options(url)
            write = opts.get("write", "back")
            if write not in ("back", "through"):
                raise ValueError(f"write={write!r} in {url!r}: use write=back or write=through")
            tiers.append(
                TierSpec(
                    tier=Tier.open(backend_url, codec),
                    capacity=parse_size(opts.get("capacity")),
                    policy=opts.get("policy", policy),
                    write=write,  # type: ignore[arg-type]
                    high=float(opts.get("high", 1.0)),
                    low=float(opts.get("low", 1.0)),
                    name=f"tier{i}",
                )
            )
        return cls(tiers, **kwargs)  # type: ignore[arg-type]

    # -- tier calls ----------------------------------------------------------------------
    async def _guard(self, j: int, coro: Coroutine[Any, Any, T], default: T, what: str, *, write: bool = False) -> T:
        """`coro` on tier `j` under the tier deadline; `default` if the tier fails or is slow.

        The first deadline miss or error opens tier `j`'s breaker: later calls return
        `default` at once (counted as refused) until a probe after the breaker's wait
        succeeds.  Other tiers are not affected.  Writes get a longer deadline (they move
        whole chunks).  Without `tier_timeout` calls are not bounded here.
        """
        breaker = self.breakers[j]
        if not breaker.allow():
            coro.close()
            self.metrics.errors.labels(op=f"{what} refused", tier=self.tier_names[j]).inc()
            return default
        timeout = self.tier_timeout
        if timeout is not None and write:
            timeout = max(30.0, 6 * timeout)
        try:
            result = await asyncio.wait_for(coro, timeout) if timeout is not None else await coro
        except asyncio.TimeoutError:
            breaker.record(False)
            self.metrics.errors.labels(op=f"{what} timeout", tier=self.tier_names[j]).inc()
            log.warning(
                "kvstore: %s on %s took longer than %.1fs; a miss, and this tier fails fast until it answers",
                what,
                self.tiers[j].name,
                timeout,
            )
            return default
        except Exception as exc:  # a tier that cannot answer holds nothing we can use now
            breaker.record(False)
            self.metrics.errors.labels(op=what, tier=self.tier_names[j]).inc()
            log.warning("kvstore: %s on %s failed: %s", what, self.tiers[j].name, exc)
            return default
        breaker.record(True)
        return result

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

    def tier_available(self, j: int) -> bool:
        """Is tier `j`'s breaker closed (calls go through)?"""
        return self.breakers[j].state is BreakerState.CLOSED

    # -- visibility ----------------------------------------------------------------------
    def _visible(self, name: str, now: float) -> int | None:
        """The tier serving `name`, or None (absent, still being written, or expired)."""
        if name in self._writing or self.book.is_expired(name, now):
            return None
        return self.placement.where(name)

    def _servable(self, name: str, now: float) -> bool:
        """Visible in a tier that is answering (a failing tier's objects are not promised)."""
        j = self._visible(name, now)
        if j is None:
            return False
        return any(
            name in self.placement.tiers[k].resident and not self.breakers[k].refusing()
            for k in range(j, len(self.tiers))
        )

    async def prefix_lookup(self, names: Sequence[str]) -> int:
        """How many leading `names` are held in some tier."""
        now = self._clock()
        await self._expire(now)
        n = 0
        for name in names:
            if not self._servable(name, now):
                break
            n += 1
        # the first unknown name decides whether the rest are worth asking about
        if n < len(names) and self.discover and (await self._found_in_tiers(names[n : n + 1], now))[0]:
            n += 1
            for found in await self._found_in_tiers(names[n:], now):
                if not found:
                    break
                n += 1
        return n

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        now = self._clock()
        await self._expire(now)
        if self.discover:
            return await self._found_in_tiers(names, now)
        return [self._servable(n, now) for n in names]

    def _discoverable(self, name: str) -> bool:
        """Unknown to the engine, and no write or copy of ours is under way."""
        return self.placement.where(name) is None and name not in self._writing and name not in self._copies

    async def _found_in_tiers(self, names: Sequence[str], now: float | None = None) -> list[bool]:
        """Visible, or (unknown to the engine) stored in some tier by someone else."""
        now = self._clock() if now is None else now
        found = [self._servable(n, now) for n in names]
        todo = [i for i, n in enumerate(names) if not found[i] and self._discoverable(n)]
        for j, tier in enumerate(self.tiers):
            if not todo:
                break
            asked = [names[i] for i in todo]
            held = await self._guard(j, tier.contains_many(asked), [False] * len(asked), "contains")
            self._found += sum(held)
            for i, h in zip(todo, held):
                found[i] = h
            todo = [i for i in todo if not found[i]]
        return found

    # -- writes --------------------------------------------------------------------------
    async def put_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        chained: bool = False,
        parent: str | None = None,
        layout: str = "raw",
    ) -> list[bool]:
        """Store tensors; see the module docstring."""
        now = self._clock()
        await self._expire(now)
        top = self.tiers[0]
        results = [False] * len(items)
        frames: list[list[memoryview] | None] = []
        for name, tensor in items:
            try:
                check_object_name(name)
            except InvalidKeyError:
                log.warning("kvstore: refusing to store invalid object name %r", name)
                frames.append(None)
                continue
            frames.append(top.codec.frame_parts(tensor, key=name, layout=layout))

        # decide everything first (synchronously: no other task sees a half-made plan)
        protected = self._protected
        moves: list[Move] = []
        writes: list[tuple[int, Move]] = []
        prev_meta = self.placement.meta.get(parent, NO_META) if parent is not None else NO_META
        prev = parent
        landed = asyncio.Event()
        for i, (name, _) in enumerate(items):
            parts = frames[i]
            if parts is None:
                continue
            size = sum(p.nbytes for p in parts)
            if chained:
                depth = prev_meta.depth + 1 if prev is not None else 0
                meta = ChunkMeta(depth=depth, parent=prev, tail=i == len(items) - 1)
                prev, prev_meta = name, meta
            else:
                meta = NO_META
            if self.placement.where(name) is None:
                room = self.book.over_quota(name, size, keep=protected)  # type: ignore[arg-type]
                if room is None:
                    self.metrics.errors.labels("quota", "-").inc()
                    continue
                for old in room:
                    moves.extend(self.placement.delete(old))
                    self.metrics.quota_evictions.labels(namespace_of(old)).inc()
                    self.book.discard(old)
            else:
                results[i] = True  # already held: the store call is a touch
            for m in self.placement.store(name, size, meta, protected):
                if name not in self.book:
                    self.book.add(name, size, now)  # reserved now: later items see the quota
                if m.kind == "write":
                    writes.append((i, m))
                    self._writing[name] += 1
                    self._landed[name] = landed
                else:
                    moves.append(m)

        await self._carry_out(moves)
        # the caller's data: written in the foreground, one batch per tier
        by_tier: dict[int, list[tuple[int, Move]]] = {}
        for i, m in writes:
            by_tier.setdefault(m.dst, []).append((i, m))  # type: ignore[arg-type]

        async def write_tier(j: int, batch: list[tuple[int, Move]]) -> None:
            tier = self.tiers[j]
            payload = []
            encoded: list[bool] = []
            for i, m in batch:
                parts = frames[i]
                if tier.codec is not top.codec and tier.codec.name != top.codec.name:
                    try:
                        parts = tier.codec.frame_parts(items[i][1], key=m.key, layout=layout)  # type: ignore[arg-type]
                    except Exception as exc:  # this tier's codec cannot take it: a failed write there
                        log.warning("kvstore: %s cannot encode %s: %s", self.tier_names[j], m.key, exc)
                        encoded.append(False)
                        continue
                encoded.append(True)
                payload.append((m.key, parts))
            t0 = time.perf_counter()
            written = iter(
                await self._guard(j, tier.put_frames(payload), [False] * len(payload), "put", write=True)  # type: ignore[arg-type]
                if payload
                else []
            )
            self.metrics.op_seconds.labels("put", self.tier_names[j]).observe(time.perf_counter() - t0)
            ok = [next(written) if e else False for e in encoded]
            for (i, m), good in zip(batch, ok):
                name = m.key
                self._writing[name] -= 1  # type: ignore[index]
                if self._writing[name] <= 0:  # type: ignore[index]
                    del self._writing[name]  # type: ignore[arg-type]
                if good and name not in self.placement.tiers[j].resident:
                    # evicted by a later chunk of this batch before it landed: a demotion
                    # (waiting for this write) has copied it on, or it was dropped
                    if name not in self._copies:  # else the name's last copy cleans up
                        await self._guard(j, tier.delete_many([name]), [False], "delete")  # type: ignore[list-item]
                    results[i] = self.placement.where(name) is not None
                elif good:
                    results[i] = True
                    self.metrics.bytes_in.labels(self.tier_names[j], namespace_of(name)).inc(m.size)  # type: ignore[arg-type]
                else:
                    self.metrics.errors.labels("put", self.tier_names[j]).inc()
                    self.placement.forget(name, j)

        try:
            await asyncio.gather(*(write_tier(j, b) for j, b in by_tier.items()))
        finally:
            landed.set()
            for _, m in writes:
                if self._landed.get(m.key) is landed:  # type: ignore[arg-type]
                    del self._landed[m.key]  # type: ignore[arg-type]
        for name, _ in items:
            if self.placement.where(name) is None:
                self.book.discard(name)
        self._update_gauges()
        return results

    # -- reads ---------------------------------------------------------------------------
    async def get_many(
        self, names: Sequence[str], out: Sequence[Out] | None = None
    ) -> list[torch.Tensor | None]:
        """Tensors for `names` (None = miss); see the module docstring for `out`."""
        now = self._clock()
        await self._expire(now)
        result: list[torch.Tensor | None] = [None] * len(names)
        groups: dict[int, list[tuple[int, int]]] = {}  # source tier -> [(index, placed tier)]
        unknown: list[int] = []
        for i, name in enumerate(names):
            j = self._visible(name, now)
            if j is None:
                if self.discover and self._discoverable(name):
                    unknown.append(i)
                continue
            src = self._landing.get((name, j), j)
            groups.setdefault(src, []).append((i, j))
            self._reading[name] += 1
        served: list[bool] = [False] * len(names)
        moves: list[Move] = []
        try:
            reads = [self._read_group(src, g, names, out, result, served) for src, g in groups.items()]
            if unknown:
                reads.append(self._discover_reads(unknown, names, out, result, served, moves, now))
            await asyncio.gather(*reads)
        finally:
            for idxs in groups.values():
                for i, _ in idxs:
                    self._reading[names[i]] -= 1
                    if self._reading[names[i]] <= 0:
                        del self._reading[names[i]]
        for i, name in enumerate(names):
            ns = namespace_of(name)
            if not served[i]:
                self.metrics.misses.labels(ns).inc()
                continue
            moves.extend(self.placement.hit(name, NO_META, self._protected))
        await self._carry_out(moves)
        self._update_gauges()
        return result

    async def _read_tier(
        self, j: int, names: Sequence[str], outs: Sequence[Out] | None
    ) -> list[tuple[torch.Tensor | None, int, int]]:
        """`_read_tier_now` under tier `j`'s deadline and breaker: UNAVAILABLE for every
        name when the tier does not answer (a miss that keeps the object on the books)."""
        fallback: list[tuple[torch.Tensor | None, int, int]] = [(None, UNAVAILABLE, 0)] * len(names)
        return await self._guard(j, self._read_tier_now(j, names, outs), fallback, "get")

    async def _read_tier_now(
        self, j: int, names: Sequence[str], outs: Sequence[Out] | None
    ) -> list[tuple[torch.Tensor | None, int, int]]:
        """(tensor, HIT | GONE | DECLINED, stored bytes) per name, read from tier `j`.

        With a target for every name: a backend that streams (disk) reads raw payloads
        straight into the targets, checksummed block by block as they land; other
        non-memory tiers read into pooled buffers that go back to the pool once decoded
        (nothing views them then)."""
        full = outs is not None and all(o is not None for o in outs)
        if full:
            res, rest = await self._read_streamed(j, names, outs)  # type: ignore[arg-type]
            if rest:
                again = await self._read_frames(j, [names[k] for k in rest], [outs[k] for k in rest])  # type: ignore[index]
                for k, r in zip(rest, again):
                    res[k] = r
            return res
        return await self._read_frames(j, names, outs)

    async def _read_streamed(
        self, j: int, names: Sequence[str], outs: Sequence[Out]
    ) -> tuple[list[tuple[torch.Tensor | None, int, int]], list[int]]:
        """Raw payloads straight into the callers' tensors, hashed block by block as they
        land; also the indices to read whole instead (not raw, or a header too long to
        stream).  A streaming backend (disk) runs `place` on its worker threads."""
        import torch

        from kvstore.backends.stream import stream_from_buffer
        from kvstore.codec.base import dtype_from_name
        from kvstore.frame_sink import FrameSink

        tier = self.tiers[j]
        n = len(names)
        targets: list[torch.Tensor | None] = [None] * n
        whole = [False] * n
        refused: list[Exception | None] = [None] * n
        stopped = False  # the read was cancelled: allocate nothing more

        def placer(k: int) -> Callable[[FrameHeader], memoryview | None]:
            def place(header: FrameHeader) -> memoryview | None:
                if stopped:
                    return None
                if header.codec != "raw":
                    whole[k] = True  # decoded by its codec: read whole
                    return None
                try:
                    t = outs[k]
                    if callable(t):
                        t = t(header)
                        if t is None:
                            return None
                    if (
                        tuple(t.shape) != tuple(header.shape)
                        or t.dtype != dtype_from_name(header.dtype)
                        or t.device.type != "cpu"
                        or not t.is_contiguous()
                    ):
                        raise ValueError(
                            f"out is {tuple(t.shape)} {t.dtype} on {t.device}; frame holds {header.shape} {header.dtype}"
                        )
                except Exception as exc:
                    refused[k] = exc
                    return None
                targets[k] = t
                if t.numel() == 0:
                    return memoryview(bytearray(0))
                return memoryview(t.reshape(-1).view(torch.uint8).numpy())

            return place

        sinks = [FrameSink(name, placer(k)) for k, name in enumerate(names)]
        if hasattr(tier.backend, "read_streamed"):
            order = iter(sinks)  # one sink per name, taken in order (a name may repeat)
            reading = asyncio.ensure_future(tier.backend.read_streamed(names, lambda _name: next(order)))
            try:
                verdicts = await asyncio.shield(reading)
            except asyncio.CancelledError:
                # the read may be writing into the callers' tensors: the caller may free them
                # only once those writes are over (at once for a backend that streams on the
                # event loop; a disk read's worker threads finish their block first)
                stopped = True
                if getattr(tier.backend, "streams_on_loop", False):
                    reading.cancel()
                await asyncio.wait({reading})
                raise
        else:  # whole objects (memory views, or pooled buffers), then streamed into the targets
            taken: list[bytearray] = []

            def alloc(size: int) -> memoryview:
                buf = self.pool.take(size)
                taken.append(buf)
                return memoryview(buf)

            try:
                raws = await tier.backend.get_many(names, alloc if self._pooled[j] else None)
                verdicts = [None if r is None else stream_from_buffer(r, sk) for r, sk in zip(raws, sinks)]
                del raws
            finally:
                for buf in taken:
                    self.pool.give(buf)
        res: list[tuple[torch.Tensor | None, int, int]] = []
        rest: list[int] = []
        for k, (name, sink) in enumerate(zip(names, sinks)):
            if verdicts[k] is None:
                tier.counters.misses += 1
                res.append((None, GONE, 0))
            elif sink.too_long or whole[k]:
                rest.append(k)
                res.append((None, GONE, 0))
            elif sink.error is not None:
                await tier._quarantine(name, sink.error)
                res.append((None, GONE, 0))
            elif not sink.placed:
                self._declined += 1
                if refused[k] is not None:
                    log.warning("kvstore: could not decode %s from %s: %s", name, tier.name, refused[k])
                tier.counters.hits += 1
                res.append((None, DECLINED, sink.header.plen))  # type: ignore[union-attr]
            else:
                tier.counters.hits += 1
                res.append((targets[k], HIT, sink.header.plen))  # type: ignore[union-attr]
        return res, rest

    async def _read_frames(
        self, j: int, names: Sequence[str], outs: Sequence[Out] | None
    ) -> list[tuple[torch.Tensor | None, int, int]]:
        """`_read_tier` through verified whole frames (pooled buffers where possible)."""
        tier = self.tiers[j]
        taken: list[bytearray] = []
        pooled = self._pooled[j] and outs is not None and all(o is not None for o in outs)

        def alloc(size: int) -> memoryview:
            buf = self.pool.take(size)
            taken.append(buf)
            return memoryview(buf)

        res: list[tuple[torch.Tensor | None, int, int]] = []
        try:
            reading = asyncio.ensure_future(tier.get_frames(names, alloc if pooled else None))
            try:
                frames = await asyncio.shield(reading)
            except asyncio.CancelledError:
                await asyncio.wait({reading})  # pooled buffers go back only once nothing writes them
                raise
            for k, (name, frame) in enumerate(zip(names, frames)):
                if frame is None:
                    res.append((None, GONE, 0))
                    continue
                size = frame.header.plen
                target = outs[k] if outs is not None else None
                try:
                    if callable(target):
                        target = target(frame.header)
                        if target is None:
                            self._declined += 1
                            res.append((None, DECLINED, size))
                            continue
                    dec = tier._decoder(frame.header.codec)
                    res.append((dec.decode_payload(frame.payload, frame.header, target), HIT, size))
                except CodecUnavailableError as exc:  # fine where it is: another process can read it
                    tier.counters.hits -= 1
                    tier.counters.misses += 1
                    tier.counters.undecodable += 1
                    log.error(
                        "kvstore: %s in %s cannot be decoded here (%s); served as a miss",
                        name,
                        tier.name,
                        exc,
                    )
                    res.append((None, DECLINED, size))
                except FrameError as exc:
                    tier.counters.hits -= 1
                    await tier._quarantine(name, exc)
                    res.append((None, GONE, 0))
                except Exception as exc:  # the caller's buffer did not fit: a miss, not a defect
                    self._declined += 1
                    log.warning("kvstore: could not decode %s from %s: %s", name, tier.name, exc)
                    res.append((None, DECLINED, size))
            del frames  # payload views end here: decoded into the caller's tensors
        finally:
            for buf in taken:
                self.pool.give(buf)
        return res

    async def _read_group(
        self,
        src: int,
        group: list[tuple[int, int]],
        names: Sequence[str],
        out: Sequence[Out] | None,
        result: list[torch.Tensor | None],
        served: list[bool],
    ) -> None:
        tier = self.tiers[src]
        sub = [names[i] for i, _ in group]
        sub_out = [out[i] for i, _ in group] if out is not None else None
        corrupt0 = tier.counters.corrupt
        t0 = time.perf_counter()
        got = await self._read_tier(src, sub, sub_out)
        self.metrics.op_seconds.labels("get", self.tier_names[src]).observe(time.perf_counter() - t0)
        bad = tier.counters.corrupt - corrupt0
        if bad:
            self.metrics.quarantines.labels(self.tier_names[src]).inc(bad)
        for (i, placed), (tensor, status, _) in zip(group, got):
            name = names[i]
            if status == GONE and placed != src:
                # read where its bytes were while a copy was landing; it may just have landed
                target = [out[i]] if out is not None else None
                tensor, status, _ = (await self._read_tier(placed, [name], target))[0]
            if status == UNAVAILABLE:
                # the tier did not answer: a lower tier holding a copy may (write-through)
                target = [out[i]] if out is not None else None
                for k in range(placed + 1, len(self.tiers)):
                    if name in self.placement.tiers[k].resident and not self.breakers[k].refusing():
                        tensor, status, _ = (await self._read_tier(k, [name], target))[0]
                        if status == HIT:
                            placed = src = k
                            break
                if status != HIT:
                    continue  # still on the books: it is a miss only while the tier is away
            if status == DECLINED:
                continue  # still stored: the caller did not take it
            if tensor is None:
                # the engine believed it held: the object is gone or was corrupt
                self.placement.forget(name, placed)
                if self.placement.where(name) is None:
                    self.book.discard(name)
                continue
            result[i] = tensor
            served[i] = True
            ns = namespace_of(name)
            self.metrics.hits.labels(self.tier_names[placed], ns).inc()
            self.metrics.bytes_out.labels(self.tier_names[src], ns).inc(
                self.placement.tiers[placed].resident.get(name, 0)
            )

    async def _discover_reads(
        self,
        todo: list[int],
        names: Sequence[str],
        out: Sequence[Out] | None,
        result: list[torch.Tensor | None],
        served: list[bool],
        moves: list[Move],
        now: float,
    ) -> None:
        """Read names the engine does not know from each tier in turn; adopt what is found,
        also in the tiers below that hold a copy (so no cleanup takes those for strays)."""
        for j in range(len(self.tiers)):
            if not todo:
                return
            sub_out = [out[i] for i in todo] if out is not None else None
            got = await self._read_tier(j, [names[i] for i in todo], sub_out)
            still = []
            adopted: list[tuple[str, int]] = []
            for i, (tensor, status, size) in zip(todo, got):
                name = names[i]
                if status in (GONE, UNAVAILABLE):
                    still.append(i)
                    continue
                if self._discoverable(name):  # nobody stored it meanwhile
                    moves.extend(self.placement.adopt(name, j, size, self._protected))
                    if self.placement.where(name) is not None and name not in self.book:
                        self.book.add(name, size, now)
                    self._discovered += 1
                    adopted.append((name, size))
                if status == HIT:
                    result[i] = tensor
                    served[i] = True
                    ns = namespace_of(name)
                    self.metrics.hits.labels(self.tier_names[j], ns).inc()
                    self.metrics.bytes_out.labels(self.tier_names[j], ns).inc(size)
            for k in range(j + 1, len(self.tiers)):
                if not adopted:
                    break
                asked = [n for n, _ in adopted]
                held = await self._guard(k, self.tiers[k].contains_many(asked), [False] * len(asked), "contains")
                for (name, size), h in zip(adopted, held):
                    if h and self.placement.where(name) is not None and name not in self._copies:
                        moves.extend(self.placement.adopt(name, k, size, self._protected))
            todo = still

    # -- deletes, pins -------------------------------------------------------------------
    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        """Remove from every tier; True where the name was held.

        With ``discover``, names the engine does not know (stored by another process or
        an earlier run) are deleted from every tier too, and count as held if a tier had them.
        """
        existed = []
        moves: list[Move] = []
        unknown: list[int] = []
        for i, name in enumerate(names):
            existed.append(self.placement.where(name) is not None)
            if self.discover and not existed[-1] and self._discoverable(name):
                unknown.append(i)
            moves.extend(self.placement.delete(name))
            self.book.discard(name)
        await self._carry_out(moves)
        if unknown:
            asked = [names[i] for i in unknown]
            for j, tier in enumerate(self.tiers):
                held = await self._guard(j, tier.delete_many(asked), [False] * len(asked), "delete")
                for i, h in zip(unknown, held):
                    existed[i] = existed[i] or h
        self._update_gauges()
        return existed

    def pin(self, names: Sequence[str], ttl: float | None = None) -> None:
        """Keep `names` from eviction for `ttl` seconds (default `pin_ttl`) or until unpinned."""
        until = self._clock() + (self.pin_ttl if ttl is None else ttl)
        for name in names:
            self._pins[name] = until

    def unpin(self, names: Sequence[str]) -> None:
        for name in names:
            self._pins.pop(name, None)

    async def _expire(self, now: float) -> None:
        if self._pins and len(self._pins) > 1024:
            self._pins = {n: t for n, t in self._pins.items() if t > now}
        gone = self.book.expired(now)
        if not gone:
            return
        moves: list[Move] = []
        for name in gone:
            moves.extend(self.placement.delete(name))
            self.book.discard(name)
            self.metrics.expired.labels(namespace_of(name)).inc()
        await self._carry_out(moves)

    # -- moves ---------------------------------------------------------------------------
    async def _carry_out(self, moves: Sequence[Move]) -> None:
        """Drops now (batched per tier); then promotions and demotions in the background.

        Drops go first so that a delete decided before a copy of the same name into the
        same tier can never land after that copy.
        """
        drops: dict[int, list[str]] = {}
        copies: list[Move] = []
        for m in moves:
            if m.kind == "drop":
                if m.key not in self._copies:
                    drops.setdefault(m.src, []).append(m.key)  # type: ignore[arg-type]
                # else: a copy may be reading it; the name's last copy cleans up
                self.metrics.evictions.labels(self.tier_names[m.src]).inc()  # type: ignore[index]
            elif m.kind in ("promote", "demote"):
                if m.kind == "demote":
                    self.metrics.evictions.labels(self.tier_names[m.src]).inc()  # type: ignore[index]
                # until the copy lands, read it where its bytes are
                src = self._landing.get((m.key, m.src), m.src)  # type: ignore[arg-type]
                self._landing[(m.key, m.dst)] = src  # type: ignore[index]
                self._copies[m.key] += 1  # type: ignore[index]
                copies.append(m)
        for j, keys in drops.items():
            t0 = time.perf_counter()
            await self._guard(j, self.tiers[j].delete_many(keys), [False] * len(keys), "delete")
            self.metrics.op_seconds.labels("delete", self.tier_names[j]).observe(time.perf_counter() - t0)
        for m in copies:
            self._spawn(self._copy(m))
        gone = []
        for m in moves:
            if m.kind == "drop" and self.placement.where(m.key) is None:
                self.book.discard(m.key)  # type: ignore[arg-type]
                gone.append(m.key)
        if gone and self.on_gone is not None:
            try:
                self.on_gone(gone)  # type: ignore[arg-type]
            except Exception:
                log.exception("kvstore: on_gone callback failed")

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        self.metrics.moves_in_flight.set(len(self._tasks))

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            self.metrics.moves_in_flight.set(len(self._tasks))
            if not t.cancelled() and t.exception() is not None:
                log.error("kvstore: background copy failed", exc_info=t.exception())

        task.add_done_callback(done)

    async def _copy(self, m: Move) -> None:
        """One promotion or demotion.  Copies of one name run one at a time (in order);
        a landing entry and the source bytes stay until the name's last copy is done."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_moves)
        name: str = m.key  # type: ignore[assignment]
        dst_i: int = m.dst  # type: ignore[assignment]
        lock = self._name_locks.setdefault(name, asyncio.Lock())
        try:
            async with lock, self._sem:
                pending = self._landed.get(name)
                if pending is not None:
                    await pending.wait()  # the source is still being written by a put
                src_i = self._landing.get((name, dst_i), m.src)
                await self._copy_into(m, name, src_i, dst_i)  # type: ignore[arg-type]
        finally:
            self._copies[name] -= 1
            if self._copies[name] <= 0:
                del self._copies[name]
                self._name_locks.pop(name, None)
                for key in [k for k in self._landing if k[0] == name]:
                    del self._landing[key]
                # the name's last copy is done: no tier keeps bytes the engine does not count
                # (a demotion's source, a promotion's source evicted meanwhile, drops that waited)
                stale = [j for j, st in enumerate(self.placement.tiers) if name not in st.resident]
                for j in stale:
                    await self.tiers[j].delete_many([name])
            self._update_gauges()

    async def _copy_into(self, m: Move, name: str, src_i: int, dst_i: int) -> None:
        if name not in self.placement.tiers[dst_i].resident:
            return  # evicted again before the copy started
        if not await self._copy_bytes(name, src_i, dst_i):
            if (await self.tiers[dst_i].contains_many([name]))[0]:
                return  # an earlier copy of the same name has landed it
            self.placement.forget(name, dst_i)
            if self.placement.where(name) is None:
                self.book.discard(name)
            return
        self.metrics.moves.labels(m.kind, self.tier_names[dst_i]).inc()
        self.metrics.bytes_in.labels(self.tier_names[dst_i], namespace_of(name)).inc(m.size)
        if name not in self.placement.tiers[dst_i].resident:
            await self.tiers[dst_i].delete_many([name])  # evicted while copying

    async def _copy_bytes(self, name: str, src_i: int, dst_i: int) -> bool:
        src, dst = self.tiers[src_i], self.tiers[dst_i]
        taken: list[bytearray] = []

        def alloc(n: int) -> memoryview:  # pooled: a fresh multi-MiB buffer costs page faults
            taken.append(self.pool.take(n))
            return memoryview(taken[-1])

        t0 = time.perf_counter()
        try:
            frame = (await src.get_frames([name], alloc))[0]
            if frame is None:
                self.metrics.errors.labels("copy", self.tier_names[src_i]).inc()
                return False
            if frame.header.codec == dst.codec.name:
                parts = [memoryview(taken[-1])]  # the verified frame as read, byte for byte
            else:
                try:
                    tensor = src._decoder(frame.header.codec).decode_payload(frame.payload, frame.header)
                except (FrameError, ValueError):
                    self.metrics.errors.labels("copy", self.tier_names[src_i]).inc()
                    return False
                parts = dst.codec.frame_parts(tensor, key=name, layout=frame.header.layout)
            ok = (await dst.put_frames([(name, parts)]))[0]  # every backend is done with the buffer here
        finally:
            for buf in taken:
                self.pool.give(buf)
        self.metrics.op_seconds.labels("copy", self.tier_names[dst_i]).observe(time.perf_counter() - t0)
        if not ok:
            self.metrics.errors.labels("put", self.tier_names[dst_i]).inc()
        return ok

    async def drain(self) -> None:
        """Wait until every background copy has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- reporting -----------------------------------------------------------------------
    def _update_gauges(self) -> None:
        for name, st in zip(self.tier_names, self.placement.tiers):
            self.metrics.tier_bytes.labels(name).set(st.used)
            self.metrics.tier_objects.labels(name).set(len(st.resident))
        for ns in self.book.namespaces():
            self.metrics.namespace_bytes.labels(ns).set(self.book.used.get(ns, 0))

    def stats(self) -> StoreStats:
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
        now = self._clock()
        return StoreStats(
            tiers=tiers,
            namespaces={
                ns: {"bytes": self.book.used.get(ns, 0), "objects": self.book.objects(ns)}
                for ns in self.book.namespaces()
            },
            moves_in_flight=len(self._tasks),
            pinned=sum(1 for t in self._pins.values() if t > now),
            declined=self._declined,
            discovered=self._discovered,
            found=self._found,
        )

    async def close(self) -> None:
        """Finish background copies, then close every tier."""
        if self._closed:
            return
        self._closed = True
        await self.drain()
        for tier in self.tiers:
            await tier.close()

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
