"""`reuse`: prefix-chain eviction and admission by learned hit density per chunk age.

Owns: `ReusePolicy`.  Must not touch: I/O, clocks (its clock counts references).

A chunk's worth is the hits it will still get per byte per unit of time it occupies the
cache.  For each class of chunks the policy learns online, from every reference, the
distribution of the gap between consecutive references (log-spaced age buckets, four per
doubling); ghosts (keys of victims and of refused chunks, kept without data) extend the
observation past what the cache holds.  From that histogram, a chunk of class c that has
gone unreferenced for age a is ranked by its best achievable *hit density*:

    rank(c, a) = max over horizons H ≥ a of  P(reuse in (a, H]) / E[space-time in (a, H]]

(the best ratio any "keep it until age H" rule can reach; no horizon is chosen by hand).

* Eviction: only leaves of prefix chains (a chunk without a resident child) are
  candidates; per class they sit in a heap by last reference, and the victim is the class
  head with the lowest rank.
* Admission: a new chunk is refused when its rank at age 0 is below the rank of the chunk
  that would be evicted for it, and a chunk whose parent was just refused is refused too
  (it could never be a prefix hit).
* Classes: hits since insertion (0, 1, 2, 3+) and whether it ended the prompt that wrote
  it (a prompt's last chunk is usually a partial block the next prompt does not share).
  A ghost that comes back keeps its hit count.

Chunks still tracked (resident or ghost) count as exposure up to their current age when
the ranks are recomputed (every quarter of the residents' count in events), so chunks
never referenced again are seen before their ghosts expire.  Counters halve after eight
events per resident chunk, so the histograms follow the workload.

Constants are structural: four age buckets per doubling, ghosts for eight times the
resident chunks, halving window eight events per resident (docs/benchmarks/policy.md
varies the last two 4x either way).  It is not the default: on the Mooncake trace it
beats `chain` on the whole trace at small capacities but not on held-out halves.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Container

from kvstore.policy.base import NO_META, NOTHING, ChunkMeta, Policy, lazy_heap_top

_SUB = 4  # age buckets per doubling
_NB = _SUB * 24  # ages up to 2**24 references
_HITS = 4


def _age_bucket(age: int) -> int:
    if age <= 0:
        return 0
    return min(int(_SUB * math.log2(1 + age)), _NB - 1)


def _bucket_width(b: int) -> float:
    lo = 2 ** (b / _SUB) - 1
    hi = 2 ** ((b + 1) / _SUB) - 1
    return max(hi - lo, 1.0)


_WIDTH = [_bucket_width(b) for b in range(_NB)]


def _cls(hits: int, tail: bool) -> int:
    return min(hits, _HITS - 1) * 2 + tail


_NCLASS = _HITS * 2


class _Entry:
    __slots__ = ("cls", "hits", "kids", "last", "parent", "size", "tail", "up")

    def __init__(self, size: int, parent: str | None, up: _Entry | None, tail: bool, hits: int, now: int):
        self.size = max(size, 1)
        self.parent = parent
        self.up = up  # the parent's entry when this one entered: a parent deleted and stored again is a new entry
        self.kids = 0
        self.hits = hits
        self.tail = tail
        self.last = now
        self.cls = _cls(hits, tail)


class ReusePolicy(Policy):
    """Leaves ranked by learned hit density at their age; admission against the next victim.

    `ghosts` (multiple of the resident chunk count) and `window` (events per resident
    chunk between halvings) override the class defaults.
    """

    name = "reuse"

    GHOSTS = 8  # ghosts remembered, as a multiple of the capacity in chunks
    WINDOW = 8  # histograms halve after this many events per resident chunk

    def __init__(self, capacity: int, *, ghosts: float | None = None, window: float | None = None) -> None:
        super().__init__(capacity)
        self.ghosts_factor = ghosts or self.GHOSTS
        self.window = window or self.WINDOW
        self._e: dict[str, _Entry] = {}
        self._bytes = 0
        self._now = 0
        self._seq = 0
        self._heaps: list[list[tuple[int, int, str]]] = [[] for _ in range(_NCLASS)]
        # key -> (last reference, class, hits) for keys not resident
        self._ghosts: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._returning: tuple[str, int] | None = None  # key, hits
        self._refused: str | None = None
        self._reuse = [[0.0] * _NB for _ in range(_NCLASS)]
        self._end = [[0.0] * _NB for _ in range(_NCLASS)]
        self._events = 0
        self._since_rank = 0
        self._rank = [[1.0] * _NB for _ in range(_NCLASS)]
        self._pushed = 0
        self._live: list[list[float]] = []

    # -- learning ------------------------------------------------------------------------
    def _event(self) -> None:
        self._events += 1
        if self._events > self.window * max(len(self._e), 64):
            self._events = 0
            for row in self._reuse:
                for i in range(_NB):
                    row[i] /= 2
            for row in self._end:
                for i in range(_NB):
                    row[i] /= 2
        self._since_rank += 1
        if self._since_rank > max(len(self._e) // 4, 64):
            self._since_rank = 0
            self._rerank()

    def _rerank(self) -> None:
        # chunks still tracked (resident or ghost) have survived to their current age:
        # they count as at risk up to it, or the never-reused would go unseen
        live = [[0.0] * _NB for _ in range(_NCLASS)]
        now = self._now
        ab = _age_bucket
        for e in self._e.values():
            live[e.cls][ab(now - e.last)] += 1
        for last, cls, _ in self._ghosts.values():
            live[cls][ab(now - last)] += 1
        self._live = live
        pool_r = [sum(self._reuse[c][b] for c in range(_NCLASS)) for b in range(_NB)]
        pool_e = [sum(self._end[c][b] + live[c][b] for c in range(_NCLASS)) for b in range(_NB)]
        pool_n = sum(pool_r) + sum(pool_e)
        k = 1.0 / pool_n if pool_n else 0.0
        for c in range(_NCLASS):
            r = [self._reuse[c][b] + k * pool_r[b] for b in range(_NB)]
            ends = [self._end[c][b] + live[c][b] + k * pool_e[b] for b in range(_NB)]
            # items reaching each bucket, and the space-time they spend in it
            n = [0.0] * (_NB + 1)
            for b in range(_NB - 1, -1, -1):
                n[b] = n[b + 1] + r[b] + ends[b]
            st = [(n[b] - (r[b] + ends[b]) / 2) * _WIDTH[b] for b in range(_NB)]
            top = max((b for b in range(_NB) if r[b] + ends[b] > 0), default=-1)
            rank = self._rank[c]
            for a in range(_NB):
                best = 0.0
                hits = 0.0
                space = 0.0
                for h in range(a, top + 1):
                    hits += r[h]
                    space += st[h]
                    if space > 0 and hits / space > best:
                        best = hits / space
                rank[a] = best

    # -- protocol ------------------------------------------------------------------------
    def miss(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._now += 1
        g = self._ghosts.pop(key, None)
        if g is None:
            self._returning = None
            return
        last, cls, hits = g
        self._reuse[cls][_age_bucket(self._now - last)] += 1
        self._event()
        self._returning = (key, hits + 1)

    def _new_entry(self, key: str, size: int, meta: ChunkMeta) -> _Entry:
        parent = meta.parent
        pe = self._e.get(parent) if parent is not None else None
        if self._returning is not None and self._returning[0] == key:
            return _Entry(size, parent if pe else None, pe, False, self._returning[1], self._now)
        return _Entry(size, parent if pe else None, pe, meta.tail, 0, self._now)

    def admit(self, key: str, size: int, meta: ChunkMeta = NO_META) -> bool:
        if meta.parent is not None and meta.parent == self._refused:
            self._refuse(key, size, meta)
            return False
        if self._bytes + size <= self.capacity:
            return True
        e = self._new_entry(key, size, meta)
        worst = self._lowest()
        if worst is not None and self._rank[e.cls][0] / e.size < worst[0]:
            self._refuse(key, size, meta, e)
            return False
        return True

    def _refuse(self, key: str, size: int, meta: ChunkMeta, e: _Entry | None = None) -> None:
        e = e or self._new_entry(key, size, meta)
        self._refused = key
        self._ghost(key, e)

    def _ghost(self, key: str, e: _Entry) -> None:
        ghosts = self._ghosts
        ghosts[key] = (e.last, e.cls, e.hits)
        limit = self.ghosts_factor * max(self.capacity // max(self._avg_size(), 1), 64)
        while len(ghosts) > limit:
            _, (last, cls, _) = ghosts.popitem(last=False)
            self._end[cls][_age_bucket(self._now - last)] += 1
            self._event()

    def _avg_size(self) -> int:
        return self._bytes // len(self._e) if self._e else 1

    def insert(self, key: str, size: int, meta: ChunkMeta = NO_META) -> None:
        if key in self._e:
            self.remove(key)
        e = self._new_entry(key, size, meta)
        self._ghosts.pop(key, None)  # refused a moment ago, stored after all
        self._returning = None
        self._refused = None
        self._e[key] = e
        self._bytes += e.size
        if e.up is not None:
            e.up.kids += 1
        self._push(key, e)

    def _push(self, key: str, e: _Entry) -> None:
        self._seq += 1
        heapq.heappush(self._heaps[e.cls], (e.last, self._seq, key))
        self._pushed += 1
        if self._pushed > 4 * len(self._e) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries: rebuild every class heap from the current leaves."""
        heaps: list[list[tuple[int, int, str]]] = [[] for _ in range(_NCLASS)]
        for i, (key, e) in enumerate(self._e.items()):
            if not e.kids:
                heaps[e.cls].append((e.last, i, key))
        for h in heaps:
            heapq.heapify(h)
        self._heaps = heaps
        self._seq = len(self._e)
        self._pushed = len(self._e)

    def touch(self, key: str, meta: ChunkMeta = NO_META) -> None:
        self._now += 1
        e = self._e.get(key)
        if e is None:
            return
        self._reuse[e.cls][_age_bucket(self._now - e.last)] += 1
        self._event()
        e.hits += 1
        e.tail = e.tail and meta.tail
        e.cls = _cls(e.hits, e.tail)
        e.last = self._now
        if not e.kids:
            self._push(key, e)

    def remove(self, key: str, evicted: bool = False) -> None:
        e = self._e.pop(key, None)
        if e is None:
            return
        self._bytes -= e.size
        if evicted:
            self._ghost(key, e)
        pe = e.up
        if pe is not None and e.parent is not None and self._e.get(e.parent) is pe:
            pe.kids -= 1
            if pe.kids == 0:
                self._push(e.parent, pe)

    def _head(self, c: int, protected: Container) -> tuple[int, str] | None:
        entries = self._e

        def live(item: tuple) -> bool:
            e = entries.get(item[2])
            return e is not None and e.last == item[0] and e.cls == c and not e.kids

        top = lazy_heap_top(self._heaps[c], live, protected)
        return None if top is None else (top[0], top[2])

    def _lowest(self, protected: Container = NOTHING) -> tuple[float, int, str] | None:
        best = None
        now = self._now
        entries = self._e
        for c in range(_NCLASS):
            h = self._head(c, protected)
            if h is None:
                continue
            last, key = h
            r = self._rank[c][_age_bucket(now - last)] / entries[key].size
            if best is None or r < best[0] or (r == best[0] and last < best[1]):
                best = (r, last, key)
        return best

    def victim(self, protected: Container = NOTHING, own: Container[str] = NOTHING) -> str | None:
        """The lowest-ranked unprotected leaf; None when every leaf is protected (a chunk
        with a resident child is never the victim: that would strand the chain below it)."""
        best = self._lowest(protected)
        return None if best is None else best[2]

    def __contains__(self, key: object) -> bool:
        return key in self._e

    def __len__(self) -> int:
        return len(self._e)
