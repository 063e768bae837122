"""How much a placement policy *could* get from what a store can observe, on a Mooncake trace.

Usage:
    python benchmarks/policy_limits.py --trace ../shared/traces/mooncake_conversation_a.jsonl [--jobs 2]

A prefix-cache hit in a conversation trace is the next turn of a conversation finding the
previous turn's prompt still cached.  So what separates a policy from Belady is knowing
*which* conversations will continue (and when).  This script measures that, in three parts:

1. The trace's conversation structure: how many requests are continued by a later one,
   by turn, and the gap to the continuation (in block references, the policies' clock).
2. How well each feature a store can observe predicts "this request will be continued"
   (ROC AUC: 0.5 is a coin, 1.0 is perfect).
3. Hit ratios of a policy that is *handed* the statistics, computed from the whole trace
   in advance (frozen, in-sample: more than any online policy can know): for each class
   of request, the probability of a continuation and the distribution of its gap.  It
   ranks chain leaves by hit density (best ratio over horizons of P(reuse) to expected
   space-time, the index `reuse` learns online) and refuses a new chunk whose density at
   age 0 is below the next victim's.  The classes go from nothing to every observable
   feature at once (with hundreds of classes the table partly memorises the trace, so
   that row flatters), and finally to an oracle that knows exactly which requests will
   be continued, but not when.

The replay is the simulator's (`kvstore.policy.simulate.replay` semantics through the
same `Placement`); only the policy differs.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
from collections.abc import Callable, Container, Hashable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvstore.policy import ChunkMeta, Placement, Policy, TierState
from kvstore.policy.base import NO_META, NOTHING, lazy_heap_top
from kvstore.policy.simulate import replay, single_tier
from kvstore.policy.trace import Request, distinct_blocks, read_trace

FRACTIONS = (0.05, 0.10, 0.25)
STEP = 250  # age bucket of the frozen gap histograms, in block references
GROUPS = 10  # request classes are pooled into at most this many probability groups


@dataclass
class Structure:
    """Per request: the request it continues (or None), its turn, clock, and whether a
    later request continues it."""

    parent: list[int | None]
    turn: list[int]
    clock: list[int]
    continued: list[bool]
    children: list[list[int]]
    prefix_hits: list[int]


def structure(reqs: list[Request]) -> Structure:
    owner: dict[int, int] = {}
    n_req = len(reqs)
    parent: list[int | None] = [None] * n_req
    hits = [0] * n_req
    clock = [0] * n_req
    children: list[list[int]] = [[] for _ in range(n_req)]
    now = 0
    for j, r in enumerate(reqs):
        n = 0
        for block in r.hash_ids:
            if block not in owner:
                break
            n += 1
        hits[j] = n
        clock[j] = now
        now += len(r.hash_ids)
        if n >= 2:  # more than a shared head: it extends an earlier prompt
            i = owner[r.hash_ids[n - 1]]
            parent[j] = i
            children[i].append(j)
        for block in r.hash_ids:
            owner[block] = j
    turn = [0] * n_req
    for j in range(n_req):
        p = parent[j]
        turn[j] = 0 if p is None else turn[p] + 1
    return Structure(parent, turn, clock, [bool(c) for c in children], children, hits)


def features(reqs: list[Request], s: Structure) -> dict[str, list[int]]:
    """What a store sees when a request's chunks arrive, per request."""
    gap = [
        -1 if s.parent[j] is None else int(math.log2(s.clock[j] - s.clock[s.parent[j]] + 1))  # type: ignore[index]
        for j in range(len(reqs))
    ]
    return {
        "turn": [min(t, 3) for t in s.turn],
        "length": [int(math.log2(len(r.hash_ids))) for r in reqs],
        "new chunks": [int(math.log2(len(r.hash_ids) - h + 1)) for r, h in zip(reqs, s.prefix_hits)],
        "gap": gap,
        "fill": [(r.input_length % 512) // 128 for r in reqs],
    }


LEVELS: dict[str, tuple[str, ...]] = {
    "no features": (),
    "turn": ("turn",),
    "turn x length": ("turn", "length"),
    "turn x length x gap": ("turn", "length", "gap"),
    "all observable (memorises)": ("turn", "length", "new chunks", "gap", "fill"),
}
ALL = "all observable (memorises)"
CROSS = "all observable, from the other half"


def auc(scores: list[float], labels: list[bool]) -> float:
    """ROC AUC by the rank-sum formula (ties get average ranks), folded to >= 0.5."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return 0.5
    a = (sum(r for r, y in zip(ranks, labels) if y) - pos * (pos + 1) / 2) / (pos * neg)
    return max(a, 1 - a)


def frozen_index(groups: list[int], prob: list[float], s: Structure, horizon: int) -> list[list[float]]:
    """rank[g][age // STEP]: best hit density over horizons for a chunk of group g."""
    n_groups = max(groups) + 1
    ages = horizon // STEP + 1
    table = []
    for g in range(n_groups):
        members = [j for j, x in enumerate(groups) if x == g]
        p = sum(prob[j] for j in members) / len(members)
        gaps = sorted(s.clock[k] - s.clock[j] for j in members for k in s.children[j])
        cdf = [bisect.bisect_right(gaps, a * STEP) / len(gaps) if gaps else 0.0 for a in range(ages)]
        row = []
        for a in range(ages):
            fa = cdf[a - 1] if a else 0.0
            best = 0.0
            space = 0.0
            prev = fa
            for h in range(a, ages):
                space += (1 - p * prev) * STEP
                prev = cdf[h]
                density = p * (cdf[h] - fa) / space
                if density > best:
                    best = density
            row.append(best)
        table.append(row)
    return table


class _Entry:
    __slots__ = ("group", "kids", "last", "parent", "tail")


class FrozenDensity(Policy):
    """Chain leaves ranked by a frozen hit-density table; admission against the next victim.

    `group_of` maps the request being replayed to its group; the replay sets `request`.
    Prompt tails (a prompt's last, usually partial, chunk) go first.
    """

    name = "frozen"

    def __init__(self, capacity: int, rank: list[list[float]], group_of: list[int]) -> None:
        super().__init__(capacity)
        self.rank = rank
        self.group_of = group_of
        self.request = 0
        self.now = 0
        self._e: dict[Hashable, _Entry] = {}
        self._heaps: dict[tuple[bool, int], list[tuple[int, Hashable]]] = {}
        self._refused: Hashable | None = None

    def _score(self, tail: bool, group: int, age: int) -> float:
        if tail:
            return -1.0 - age
        row = self.rank[group]
        return row[min(age // STEP, len(row) - 1)]

    def _push(self, key: Hashable, e: _Entry) -> None:
        heapq.heappush(self._heaps.setdefault((e.tail, e.group), []), (e.last, key))

    def miss(self, key: Hashable, meta: ChunkMeta = NO_META) -> None:
        self.now += 1

    def touch(self, key: Hashable, meta: ChunkMeta = NO_META) -> None:
        self.now += 1
        e = self._e.get(key)
        if e is None:
            return
        e.last = self.now
        e.tail = e.tail and meta.tail
        e.group = self.group_of[self.request]
        self._push(key, e)

    def admit(self, key: Hashable, size: int, meta: ChunkMeta = NO_META) -> bool:
        if meta.parent is not None and meta.parent == self._refused:
            self._refused = key
            return False
        if len(self._e) < self.capacity:
            return True
        found = self._lowest(NOTHING)
        if found is not None and self._score(meta.tail, self.group_of[self.request], 0) < found[0]:
            self._refused = key
            return False
        return True

    def insert(self, key: Hashable, size: int, meta: ChunkMeta = NO_META) -> None:
        e = _Entry()
        e.kids = 0
        e.last = self.now
        e.tail = meta.tail
        e.group = self.group_of[self.request]
        pe = self._e.get(meta.parent) if meta.parent is not None else None
        e.parent = meta.parent if pe is not None else None
        if pe is not None:
            pe.kids += 1
        self._e[key] = e
        self._push(key, e)

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        e = self._e.pop(key, None)
        if e is None or e.parent is None:
            return
        pe = self._e.get(e.parent)
        if pe is not None:
            pe.kids -= 1
            if not pe.kids:
                self._push(e.parent, pe)

    def _lowest(self, protected: Container) -> tuple[float, Hashable] | None:
        best: tuple[float, Hashable] | None = None
        for (tail, group), heap in self._heaps.items():

            def live(item: tuple, tail: bool = tail, group: int = group) -> bool:
                e = self._e.get(item[-1])
                return (
                    e is not None and e.last == item[0] and e.tail == tail and e.group == group and not e.kids
                )

            top = lazy_heap_top(heap, live, protected)
            if top is not None:
                score = self._score(tail, group, self.now - top[0])
                if best is None or score < best[0]:
                    best = (score, top[-1])
        return best

    def victim(self, protected: Container = NOTHING, own: Container = NOTHING) -> Hashable | None:
        found = self._lowest(protected)
        if found is not None:
            return found[1]
        return next((k for k in self._e if k not in protected), None)

    def __contains__(self, key: object) -> bool:
        return key in self._e

    def __len__(self) -> int:
        return len(self._e)


def replay_frozen(reqs: list[Request], fraction: float, policy_of: Callable[[int], FrozenDensity]) -> float:
    """The simulator's replay, one request at a time so the policy knows which one it is."""
    cap = int(fraction * distinct_blocks(reqs))
    policy = policy_of(cap)
    placement = Placement([TierState(capacity=cap, policy=policy, name="tier0")])
    hits = 0
    for j, r in enumerate(reqs):
        policy.request = j
        hits += replay(placement, [r])
    return hits / sum(len(r.hash_ids) for r in reqs)


def grouping(prob: list[float]) -> list[int]:
    """Requests pooled into at most GROUPS groups of similar continuation probability."""
    values = sorted(set(prob))
    if len(values) <= GROUPS:
        where = {v: i for i, v in enumerate(values)}
        return [where[p] for p in prob]
    ordered = sorted(prob)
    edges = [ordered[len(ordered) * k // GROUPS] for k in range(1, GROUPS)]
    raw = [bisect.bisect_right(edges, p) for p in prob]
    used = {g: i for i, g in enumerate(sorted(set(raw)))}
    return [used[g] for g in raw]


def _cell_rates(keys: list[tuple], labels: list[bool], members: range) -> dict[tuple, list[int]]:
    cells: dict[tuple, list[int]] = {}
    for j in members:
        cell = cells.setdefault(keys[j], [0, 0])
        cell[0] += 1
        cell[1] += labels[j]
    return cells


def level_probabilities(level: str, feats: dict[str, list[int]], s: Structure) -> tuple[list[float], int]:
    """Each request's continuation probability at an information level, and the cell count.

    Levels in `LEVELS` use the whole trace's rate in the request's cell (in-sample);
    "cross-fitted" takes every feature's cell rate from the *other* half of the trace
    (cells seen fewer than 5 times there fall back to the turn's rate); "oracle" knows.
    """
    n = len(s.continued)
    if level == "oracle":
        return [0.99 if c else 0.01 for c in s.continued], 2
    if level == CROSS:
        keys = [tuple(feats[f][j] for f in LEVELS[ALL]) for j in range(n)]
        turns = [(feats["turn"][j],) for j in range(n)]
        half = n // 2
        prob = [0.0] * n
        cells = 0
        for mine, other in ((range(half), range(half, n)), (range(half, n), range(half))):
            fine = _cell_rates(keys, s.continued, other)
            coarse = _cell_rates(turns, s.continued, other)
            cells += len(fine)
            for j in mine:
                cell = fine.get(keys[j])
                if cell is None or cell[0] < 5:
                    cell = coarse.get(turns[j], [1, 0])
                prob[j] = cell[1] / cell[0]
        return prob, cells
    names = LEVELS[level]
    keys = [tuple(feats[f][j] for f in names) for j in range(n)]
    cells_all = _cell_rates(keys, s.continued, range(n))
    return [cells_all[k][1] / cells_all[k][0] for k in keys], len(cells_all)


_STATE: dict = {}


def _job(args: tuple[str, float]) -> tuple[str, float, float, int]:
    level, fraction = args
    reqs, s, feats = _STATE["reqs"], _STATE["s"], _STATE["feats"]
    prob, cells = level_probabilities(level, feats, s)
    groups = grouping(prob)
    horizon = max(s.clock) + 1
    rank = frozen_index(groups, prob, s, min(horizon, 100_000))
    ratio = replay_frozen(reqs, fraction, lambda cap: FrozenDensity(cap, rank, groups))
    return level, fraction, ratio, cells


def _peer(args: tuple[str, float]) -> tuple[str, float, float, int]:
    policy, fraction = args
    return policy, fraction, single_tier(_STATE["reqs"], fraction, policy).hit_ratio, 0


def _init(path: str) -> None:
    reqs = read_trace(path)
    s = structure(reqs)
    _STATE.update(reqs=reqs, s=s, feats=features(reqs, s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    _init(opts.trace)
    reqs, s, feats = _STATE["reqs"], _STATE["s"], _STATE["feats"]

    refs = sum(len(r.hash_ids) for r in reqs)
    print(
        f"## Structure\n\n{len(reqs)} requests, {refs} block references, {distinct_blocks(reqs)} distinct blocks"
    )
    print(f"infinite cache: {sum(s.prefix_hits) / refs:.3f}")
    print("\n| turn | requests | continued |\n|---:|---:|---:|")
    for t in range(4):
        members = [j for j in range(len(reqs)) if min(s.turn[j], 3) == t]
        share = sum(s.continued[j] for j in members) / len(members) if members else 0.0
        print(f"| {t}{'+' if t == 3 else ''} | {len(members)} | {share:.3f} |")
    gaps = sorted(s.clock[k] - s.clock[j] for j in range(len(reqs)) for k in s.children[j])
    if gaps:
        qs = ", ".join(
            f"{int(q * 100)}%: {gaps[int(q * (len(gaps) - 1))]}" for q in (0.1, 0.25, 0.5, 0.75, 0.9)
        )
        print(f"\ngap to the continuation, block references: {qs}")

    print("\n## Predicting a continuation (ROC AUC)\n\n| feature | AUC |\n|---|---:|")
    for name, values in feats.items():
        print(f"| {name} | {auc([float(v) for v in values], s.continued):.3f} |")

    levels = [*LEVELS, CROSS, "oracle"]
    jobs = [(level, f) for level in levels for f in FRACTIONS]
    peers = [(p, f) for p in ("lru", "chain", "reuse", "belady") for f in FRACTIONS]
    with ProcessPoolExecutor(opts.jobs, initializer=_init, initargs=(opts.trace,)) as pool:
        results = list(pool.map(_job, jobs)) + list(pool.map(_peer, peers))
    table: dict[str, dict[float, float]] = {}
    classes: dict[str, int] = {}
    for name, fraction, ratio, n_classes in results:
        table.setdefault(name, {})[fraction] = ratio
        classes[name] = n_classes
    print("\n## Hit ratio with statistics handed over in advance\n")
    print("| information | cells | " + " | ".join(f"{int(f * 100)}%" for f in FRACTIONS) + " |")
    print("|---|---:|" + "---:|" * len(FRACTIONS))
    for name in [*levels, "lru", "chain", "reuse", "belady"]:
        label = {
            "oracle": "oracle: which requests continue",
            "lru": "lru (online)",
            "chain": "chain (online, default)",
            "reuse": "reuse (online)",
            "belady": "belady (the future)",
        }.get(name, name)
        n = str(classes[name]) if name in levels else ""
        print(f"| {label} | {n} | " + " | ".join(f"{table[name][f]:.3f}" for f in FRACTIONS) + " |")


if __name__ == "__main__":
    main()
