"""`chain` (the default policy): prefix-chain aware eviction, learned online.

Owns: `ChainPolicy`.  Must not touch: I/O, clocks (its clock counts references).

Four ideas; none is fitted to a particular trace:

1. **Chains shrink from the tail.**  A chunk is only useful while every chunk before it
   in its prefix chain is held (a prefix lookup stops at the first miss), so only
   *leaves* — chunks with no resident child — are eviction candidates.  Evicting a tail
   before its head never strands unusable chunks, and a head shared by many prompts (a
   system prompt, a shared document) stays while anything hangs off it.
2. **Reuse probability per class, learned online.**  A chunk's class is how often it has
   been hit (0, 1, 2, 3, 4–7, 8+), whether it ended the prompt that wrote it (a prompt's
   last chunk is usually a partial block the next prompt extends into a different
   chunk) and its depth in the chain (log buckets).  For every class the policy counts
   the chunks that entered it and those referenced again — by a hit, or by a miss on a
   *ghost* (a recent victim's key, kept without data).  Ghosts make the estimate
   independent of the policy's own choices, and a ghost that comes back keeps its hit
   history.  Counters halve periodically, so estimates follow the workload.
3. **Two experts order the leaves.**  *GreedyDual* (Cao & Irani): priority
   ``L + p(class) × cost / size`` on each reference, L = the last victim's priority —
   a chunk lives in proportion to its estimated reuse per byte (× recompute cost).
   *Gated recency*: least recently used first, but chunks never reused (no hit, no
   ghost history) before any reused one — what a small cache needs when most new
   chunks are never read again (a frequency filter, as TinyLFU's, without a window).
4. **Shadows pick the expert.**  Each expert also runs alone on a metadata-only shadow
   of the same size that sees every reference; the real cache evicts with the expert
   whose shadow has hit most recently (scores halve periodically).  Both orderings are
   kept up to date all the time, so switching expert never mixes priority scales.

Cost: the shadows make it about three times the work of one ordering; still pure
dict/heap Python (a 150k-reference trace replays in seconds).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container

from kvstore.policy.base import NO_META, NOTHING, ChunkMeta, Policy, lazy_heap_top

_HIT_BUCKETS = 6  # 0, 1, 2, 3, 4-7, 8+ hits since insertion
_DEPTHS = 5  # depth 0, 1-3, 4-15, 16-63, 64+
_NCLASS = 2 * _HIT_BUCKETS * _DEPTHS


def _depth_bucket(depth: int) -> int:
    return 0 if depth <= 0 else min((depth.bit_length() + 1) // 2, _DEPTHS - 1)


_HIT_BUCKET = (0, 1, 2, 3, 4, 4, 4, 4)


def _class(hits: int, tail: bool, depth: int = 0) -> int:
    return _class_of(hits, tail, _depth_bucket(depth))


def _class_of(hits: int, tail: bool, dbucket: int) -> int:
    b = _HIT_BUCKET[hits] if hits < 8 else 5
    return (2 * b + tail) * _DEPTHS + dbucket


_REUSED = float(1 << 40)  # lifts reused chunks above any recency stamp


class _Entry:
    __slots__ = ("cls", "cost", "dbucket", "hits", "kids", "parent", "prio", "size", "tail", "up")

    def __init__(self, size: int, parent: str | None, up: _Entry | None, meta: ChunkMeta, experts: int) -> None:
        self.size = max(size, 1)
        self.parent = parent
        self.up = up  # the parent's entry when this one entered: a parent deleted and stored again is a new entry
        self.kids = 0
        self.hits = 0
        self.tail = meta.tail
        self.cost = meta.cost
        self.dbucket = _depth_bucket(meta.depth)
        self.cls = _class_of(0, meta.tail, self.dbucket)
        self.prio = [0.0] * experts


class ChainPolicy(Policy):
    name = "chain"

    #: ghosts remembered, as a multiple of the resident count
    GHOSTS = 4
    #: class counters are halved after this many class entries per resident chunk
    WINDOW = 8
    #: the experts: alpha > 0 is GreedyDual with value p(class) ** alpha; 0 is gated recency
    ALPHAS = (1.0, 0.0)
    #: gated recency: hit-count levels (2: never reused / reused)
    LEVELS = 2
    #: shadow scores are halved after this many references per resident chunk
    SCORE_WINDOW = 8

    def __init__(self, capacity: int, *, alphas: tuple[float, ...] | None = None) -> None:
        super().__init__(capacity)
        self.alphas = alphas or self.ALPHAS
        self._e: dict[str, _Entry] = {}
        self._heaps: list[list[tuple[float, int, str]]] = [[] for _ in self.alphas]
        self._L = [0.0 for _ in self.alphas]
        # one shadow cache per expert when there is a choice to make
        self._shadows = [_Shadow(capacity, a) for a in self.alphas] if len(self.alphas) > 1 else []
        self.expert = 0
        self._seq = 0
        self._now = 0
        self._ghosts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (class, hits)
        self._returning: tuple[str, int] | None = None
        self._shadow_refs = 0
        # one pseudo-entry per class at probability 1/4 keeps early estimates finite and equal
        self._entered = [1.0] * _NCLASS
        self._reused = [0.25] * _NCLASS
        self._events = 0

    # -- estimates -----------------------------------------------------------------------
    def reuse_probability(self, cls: int) -> float:
        """Estimated chance that a chunk of class `cls` is referenced again."""
        return self._reused[cls] / self._entered[cls]

    def _classify(self, key: str, e: _Entry) -> None:
        self._entered[e.cls] += 1
        self._events += 1
        if self._events > self.WINDOW * max(len(self._e), 64):
            self._events = 0
            self._entered = [x / 2 for x in self._entered]
            self._reused = [x / 2 for x in self._reused]
        p = self.reuse_probability(e.cls) * e.cost / e.size
        self._seq += 1
        for k, alpha in enumerate(self.alphas):
            if alpha > 0:
                e.prio[k] = self._L[k] + p**alpha
            else:  # recency, chunks never reused going first
                e.prio[k] = self._now + _REUSED * min(e.hits, self.LEVELS - 1)
            heapq.heappush(self._heaps[k], (e.prio[k], self._seq, key))

    def _push(self, key: str, e: _Entry) -> None:
        self._seq += 1
        for k in range(len(self.alphas)):
            heapq.heappush(self._heaps[k], (e.prio[k], self._seq, key))

    # -- policy protocol -----------------------------------------------------------------
    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._now += 1
        ghost = self._ghosts.pop(key, None)
        if ghost is None:
            return
        cls, hits = ghost
        self._reused[cls] += 1
        self._returning = (key, hits + 1)

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        if key in self._e:
            self.remove(key)
        parent = meta.parent
        pe = self._e.get(parent) if parent is not None else None
        if pe is None:
            parent = None
        else:
            pe.kids += 1
        e = self._e[key] = _Entry(size, parent, pe, meta, len(self._L))
        if self._returning is not None and self._returning[0] == key:
            # a ghost come back: it keeps its history, plus this reference
            e.hits = self._returning[1]
            e.tail = False
            e.cls = _class_of(e.hits, False, e.dbucket)
        self._returning = None
        self._classify(key, e)
        if self._shadows:
            self._observe(key, meta, e.size)

    def _observe(self, key: str, meta: ChunkMeta, size: int) -> None:
        """Replay a reference in every shadow; follow the expert whose shadow hits most."""
        for sh in self._shadows:
            sh.reference(key, meta, size)
        self._shadow_refs += 1
        if self._shadow_refs >= self.SCORE_WINDOW * max(len(self._e), 64):
            self._shadow_refs = 0
            for sh in self._shadows:
                sh.score /= 2
        best = self.expert
        for k, sh in enumerate(self._shadows):
            if sh.score > self._shadows[best].score:
                best = k
        self.expert = best

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._now += 1
        e = self._e.get(key)
        if e is None:
            return
        self._reused[e.cls] += 1
        e.hits += 1
        e.tail = e.tail and meta.tail  # referenced as the middle of a prompt: no longer a tail
        e.cls = _class_of(e.hits, e.tail, e.dbucket)
        self._classify(key, e)
        if self._shadows:
            self._observe(key, meta, e.size)

    def remove(self, key: str, evicted: bool = False) -> None:
        e = self._e.pop(key, None)
        if e is None:
            return
        if evicted:
            for k in range(len(self._L)):
                if e.prio[k] > self._L[k]:
                    self._L[k] = e.prio[k]
            ghosts = self._ghosts
            ghosts[key] = (e.cls, e.hits)
            limit = self.GHOSTS * max(len(self._e), 1)
            while len(ghosts) > limit:
                ghosts.popitem(last=False)
        pe = e.up
        if pe is not None and e.parent is not None and self._e.get(e.parent) is pe:
            pe.kids -= 1
            if pe.kids == 0:
                self._push(e.parent, pe)

    def _best_leaf(self, k: int, protected: Container) -> str | None:
        heap = self._heaps[k]
        entries = self._e

        def live(item: tuple) -> bool:  # not stale, and still a leaf (re-pushed when it becomes one)
            e = entries.get(item[2])
            return e is not None and e.prio[k] == item[0] and not e.kids

        top = lazy_heap_top(heap, live, protected)
        found = None if top is None else top[2]
        if len(heap) > 4 * len(entries) + 1024:
            self._compact(k)
        return found

    def victim(self, protected: Container = NOTHING, own: Container[str] = NOTHING) -> str | None:
        """The best unprotected leaf; None when every leaf is protected (a chunk with a
        resident child is never the victim: evicting it would strand the chain below it,
        e.g. a store batch hanging off a head stored by an earlier request)."""
        return self._best_leaf(self.expert, protected)

    def _compact(self, k: int) -> None:
        heap = [(e.prio[k], i, key) for i, (key, e) in enumerate(self._e.items()) if not e.kids]
        heapq.heapify(heap)
        self._heaps[k] = heap

    def __contains__(self, key: object) -> bool:
        return key in self._e

    def __len__(self) -> int:
        return len(self._e)


class _Shadow:
    """A metadata-only copy of the cache run by one expert alone, to score that expert.

    It sees every reference the real cache sees, admits everything, evicts within the
    same budget, and counts (decayed) hits.
    """

    __slots__ = ("policy", "score", "sizes", "used")

    def __init__(self, capacity: int, alpha: float) -> None:
        self.policy = ChainPolicy(capacity, alphas=(alpha,))
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.score = 0.0

    def reference(self, key: str, meta: ChunkMeta, size: int) -> None:
        pol = self.policy
        if key in self.sizes:
            self.score += 1
            pol.touch(key, meta)
            return
        pol.miss(key, meta)
        if size > pol.capacity:
            return
        while self.used + size > pol.capacity:
            victim = pol.victim()
            if victim is None:
                return
            pol.remove(victim, evicted=True)
            self.used -= self.sizes.pop(victim)
        pol.insert(key, size, meta)
        self.sizes[key] = size
        self.used += size
