"""`chain` (the default policy): prefix-chain aware GreedyDual with online reuse estimates.

Owns: `ChainPolicy`.  Must not touch: I/O, clocks.

Three ideas, none fitted to a particular trace:

1. **Chains shrink from the tail.**  A chunk is only useful while every chunk before it
   in its prefix chain is held (a prefix lookup stops at the first miss), so only
   *leaves* — chunks with no resident child — are eviction candidates.  Evicting a tail
   before its head never strands unusable chunks, and a head shared by many prompts (a
   system prompt, a shared document) stays while anything hangs off it.
2. **Reuse probability per class, learned online.**  Each chunk is in a class: how often
   it has been hit since it arrived (0, 1, 2, 3, 4–7, 8+) and whether it ended the prompt
   that wrote it (a prompt's last chunk is usually a partial block that the next prompt
   extends into a different chunk).  For every class the policy counts how many chunks
   entered it and how many of those were referenced again — by a hit, or by a miss on a
   *ghost* (the key of a recent victim, remembered without data).  Ghosts make the
   estimate independent of the policy's own choices: a class it evicts early still shows
   how often it would have been reused.  Counters are halved periodically, so estimates
   follow a changing workload.
3. **GreedyDual aging** (Cao & Irani; GDSF).  On insert or hit a chunk's priority is
   ``L + p(class) × cost / size`` where L is the priority of the last victim; the victim
   is the leaf of least priority.  A chunk thus lives in proportion to its estimated
   reuse probability per byte (× recompute cost), and stale chunks fall below fresh ones
   as L rises.

With no history every class starts at the same estimate and the policy behaves like LRU
over chain leaves.
"""

from __future__ import annotations

import heapq
import zlib
from collections import OrderedDict
from collections.abc import Container, Hashable

from kvstore.policy.base import NO_META, NOTHING, ChunkMeta, Policy

_HIT_BUCKETS = 6  # 0, 1, 2, 3, 4-7, 8+ hits since insertion
_DEPTHS = 5  # depth 0, 1-3, 4-15, 16-63, 64+
_NCLASS = 2 * _HIT_BUCKETS * _DEPTHS


def _depth_bucket(depth: int) -> int:
    return 0 if depth <= 0 else min((depth.bit_length() + 1) // 2, _DEPTHS - 1)


def _class(hits: int, tail: bool, depth: int = 0) -> int:
    b = hits if hits < 4 else (4 if hits < 8 else 5)
    return (2 * b + int(tail)) * _DEPTHS + _depth_bucket(depth)


class _Entry:
    __slots__ = ("cls", "cost", "depth", "hits", "kids", "parent", "prio", "size", "tail")

    def __init__(self, size: int, parent: Hashable | None, meta: ChunkMeta) -> None:
        self.size = max(size, 1)
        self.parent = parent
        self.kids = 0
        self.hits = 0
        self.tail = meta.tail
        self.cost = meta.cost
        self.depth = meta.depth
        self.cls = _class(0, meta.tail, meta.depth)
        self.prio = 0.0


class ChainPolicy(Policy):
    name = "chain"

    #: ghosts remembered, as a multiple of the resident count
    GHOSTS = 4
    #: counters are halved after this many class entries per resident chunk
    WINDOW = 8

    #: exponents tried by the shadow caches: priority uses p(class) ** alpha
    ALPHAS = (1.0, 2.0, 4.0, 8.0)
    #: shadows see one key in this many (and a budget this much smaller)
    SAMPLE = 4

    def __init__(self, capacity: int, *, alpha: float = 1.0, shadows: bool = True) -> None:
        super().__init__(capacity)
        self.alpha = alpha
        self._shadows: list[_Shadow] = []
        if shadows:
            self._shadows = [_Shadow(capacity // self.SAMPLE, a) for a in self.ALPHAS]
            self._shadow_refs = 0
        self._e: dict[Hashable, _Entry] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._L = 0.0
        self._ghosts: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # key -> (class, hits)
        self._returning: tuple[Hashable, int] | None = None
        # one pseudo-entry per class at probability 1/4 keeps early estimates finite and equal
        self._entered = [1.0] * _NCLASS
        self._reused = [0.25] * _NCLASS
        self._events = 0
        self._last_size = 1  # size of the latest insert: the size a shadow assumes on a miss

    # -- estimates -----------------------------------------------------------------------
    def reuse_probability(self, cls: int) -> float:
        """Estimated chance that a chunk of class `cls` is referenced again."""
        return self._reused[cls] / self._entered[cls]

    def value(self, cls: int) -> float:
        """A class's worth per byte, in [0, 1]: its reuse probability relative to the best
        class, raised to `alpha` (so switching `alpha` keeps priorities on one scale)."""
        best = max(r / e for r, e in zip(self._reused, self._entered))
        return (self.reuse_probability(cls) / best) ** self.alpha

    def _push(self, key: Hashable, e: _Entry) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (e.prio, self._seq, key))

    # -- policy protocol -----------------------------------------------------------------
    def _observe(self, key: Hashable, meta: ChunkMeta, size: int) -> None:
        """Feed a reference to the shadows; follow the best of them."""
        if not _sampled(key, self.SAMPLE):
            return
        for sh in self._shadows:
            sh.reference(key, meta, size)
        self._shadow_refs += 1
        if self._shadow_refs >= 256:
            self._shadow_refs = 0
            best = max(self._shadows, key=lambda sh: sh.score)
            self.alpha = best.policy.alpha
            for sh in self._shadows:
                sh.score *= 0.99

    def miss(self, key: Hashable, meta: ChunkMeta = NO_META) -> None:
        if self._shadows:
            self._observe(key, meta, self._last_size)
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._reused[ghost[0]] += 1
            self._returning = (key, ghost[1] + 1)

    def insert(self, key: Hashable, size: int, meta: ChunkMeta = NO_META) -> None:
        if key in self._e:
            self.remove(key)
        parent = meta.parent
        pe = self._e.get(parent) if parent is not None else None
        if pe is None:
            parent = None
        else:
            pe.kids += 1
        e = self._e[key] = _Entry(size, parent, meta)
        self._last_size = e.size
        if self._returning is not None and self._returning[0] == key:
            # a ghost come back: it keeps its history, plus this reference
            e.hits = self._returning[1]
            e.tail = False
            e.cls = _class(e.hits, False, e.depth)
        self._returning = None
        self._classify(key, e)

    def _classify(self, key: Hashable, e: _Entry) -> None:
        self._entered[e.cls] += 1
        self._events += 1
        if self._events > self.WINDOW * max(len(self._e), 64):
            self._events = 0
            self._entered = [x / 2 for x in self._entered]
            self._reused = [x / 2 for x in self._reused]
        e.prio = self._L + self.value(e.cls) * e.cost / e.size
        self._push(key, e)

    def touch(self, key: Hashable, meta: ChunkMeta = NO_META) -> None:
        e = self._e.get(key)
        if e is None:
            return
        if self._shadows:
            self._observe(key, meta, e.size)
        self._reused[e.cls] += 1
        e.hits += 1
        e.tail = e.tail and meta.tail  # referenced as the middle of a prompt: no longer a tail
        e.cls = _class(e.hits, e.tail, e.depth)
        self._classify(key, e)

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        e = self._e.pop(key, None)
        if e is None:
            return
        if evicted:
            if e.prio > self._L:
                self._L = e.prio
            ghosts = self._ghosts
            ghosts[key] = (e.cls, e.hits)
            limit = self.GHOSTS * max(len(self._e), 1)
            while len(ghosts) > limit:
                ghosts.popitem(last=False)
        if e.parent is not None:
            pe = self._e.get(e.parent)
            if pe is not None:
                pe.kids -= 1
                if pe.kids == 0:
                    self._push(e.parent, pe)

    def victim(self, protected: Container = NOTHING) -> Hashable | None:
        heap = self._heap
        entries = self._e
        held = []
        found = None
        while heap:
            prio, _, key = heap[0]
            e = entries.get(key)
            if e is None or e.prio != prio or e.kids:
                heapq.heappop(heap)  # stale, or no longer a leaf (re-pushed when it is)
                continue
            if key in protected:
                held.append(heapq.heappop(heap))
                continue
            found = key
            break
        for item in held:
            heapq.heappush(heap, item)
        if len(heap) > 4 * len(entries) + 1024:
            self._compact()
        if found is None:  # every leaf protected: any unprotected resident
            for key in entries:
                if key not in protected:
                    return key
        return found

    def _compact(self) -> None:
        self._heap = []
        for key, e in self._e.items():
            if not e.kids:
                self._push(key, e)
        heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._e

    def __len__(self) -> int:
        return len(self._e)


def _sampled(key: Hashable, rate: int) -> bool:
    """A stable 1-in-`rate` choice of keys (the same in every process: no salted hash)."""
    if rate <= 1:
        return True
    if isinstance(key, int):
        h = (key * 0x9E3779B97F4A7C15) >> 32 & 0xFFFFFFFF
    else:
        h = zlib.crc32(str(key).encode())
    return h % rate == 0


class _Shadow:
    """A metadata-only miniature of the cache on a key sample, run with one `alpha`.

    It admits every sampled reference, evicts within its own (scaled) budget, and scores
    a (decayed) hit for each sampled reference it holds.
    """

    __slots__ = ("policy", "score", "sizes", "used")

    def __init__(self, capacity: int, alpha: float) -> None:
        self.policy = ChainPolicy(max(capacity, 1), alpha=alpha, shadows=False)
        self.sizes: dict[Hashable, int] = {}
        self.used = 0
        self.score = 0.0

    def reference(self, key: Hashable, meta: ChunkMeta, size: int) -> None:
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
