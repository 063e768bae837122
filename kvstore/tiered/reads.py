"""The read path of a TieredStore: which tier each name is read from, and what a read
changes in the books.

Owns: `Reader`: grouping a batch by the tier holding each name's bytes (a name whose
copy is still landing is read where its bytes are), one guarded `Tier.read_into` per
group, falling back to a lower tier holding a copy when a tier does not answer,
discovery reads of names the engine does not know (adopting what is found), and the
engine's hits (promotions) afterwards.  Must not touch: tensor ↔ frame work (that is
`Tier.read_into`: streamed or pooled reads, decoding, quarantine), the engine's rules.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.namespaces import namespace_of
from kvstore.policy import NO_META, Move
from kvstore.tier_stream import DECLINED, GONE, HIT, Out, ReadResult
from kvstore.tiered.lookup import Lookup
from kvstore.tiered.moves import Mover
from kvstore.tiered.parts import Parts

if TYPE_CHECKING:
    import torch

UNAVAILABLE = 3  # a `ReadResult.status`: the tier did not answer (the object stays on the books)


UNANSWERED_LIMIT = 3
"""Reads in a row a name may be not found while its tier counts errors, before it counts
as gone: a tier away for a moment keeps its names; one object failing every read (a
file with an I/O error, a key of another type) or found gone beside such failures
leaves the books. A failed read counts towards it when the tier answered other reads in
the same batch, or in any read since the name's last failed one (so an object read
alone, batch after batch, leaves too); a tier that answers nothing counts nothing."""

clock = time.monotonic  # (tests set the time)

UNANSWERED_MIN_S = 30.0
"""And for at least this long since the first counted failure: a part of a tier away
while the rest answers (a Redis Cluster shard failing over, a flapping link) does not
cost its names."""

UNANSWERED_FORGET_S = 600.0
"""A name whose last failed read is older than this starts a new streak (the count of a
fault long past does not shorten the next one)."""


class Reader:
    def __init__(self, parts: Parts, lookup: Lookup, mover: Mover) -> None:
        self.p = parts
        self.lookup = lookup
        self.mover = mover
        # (tier, name) -> (failed reads counted in a row, the tier's answers at the last
        # one, when the first was counted, when the last failed)
        self._unanswered: dict[tuple[int, str], tuple[int, int, float, float]] = {}
        self._answers: list[int] = [0] * len(parts.tiers)  # reads each tier answered (found or not)
        # batches each tier answered off the loop (`answered_off_loop`, counted as they end)
        self._answers_off: list[int] = [0] * len(parts.tiers)
        self._answers_off_lock = threading.Lock()
        # keeps the books of reads off the loop that have ended (`DirectReads.settle_pending`)
        self.settle_first: Callable[[], None] = lambda: None

    async def get_many(self, names: Sequence[str], out: Sequence[Out] | None, now: float) -> list[torch.Tensor | None]:
        """Tensors for `names` (None = miss), from the highest tier holding each."""
        p = self.p
        result: list[torch.Tensor | None] = [None] * len(names)
        groups: dict[int, list[tuple[int, int, int]]] = {}  # source tier -> [(index, placed tier, mark)]
        unknown: list[int] = []
        reading: list[str] = []
        for i, name in enumerate(names):
            j = self.lookup.visible(name, now)
            if j is None:
                if p.discover and self.lookup.discoverable(name):
                    unknown.append(i)
                continue
            groups.setdefault(p.inflight.source(name, j), []).append((i, j, p.inflight.placements(name, j)))
            reading.append(name)
        served: list[bool] = [False] * len(names)
        moves: list[Move] = []
        ticket = p.inflight.prepare_read(reading)
        try:
            reads = [self._read_group(src, g, names, out, result, served) for src, g in groups.items()]
            if unknown:
                reads.append(self._discover(unknown, names, out, result, served, moves, now))
            await asyncio.gather(*reads)
        finally:
            p.inflight.complete(ticket)
        with p.changing():  # a hit may promote, and so choose victims: one stretch
            for i, name in enumerate(names):
                if not served[i]:
                    p.metrics.misses.labels(namespace_of(name)).inc()
                    continue
                moves.extend(p.placement.hit(name, NO_META, p.inflight))
            drops = self.mover.begin(moves)  # (in the stretch: a copy's landing marks with its placing)
        await self.mover.finish(drops)
        p.update_gauges()
        return result

    async def read_tier(self, j: int, names: Sequence[str], outs: Sequence[Out] | None) -> list[ReadResult]:
        """`Tier.read_into` under tier `j`'s deadline and breaker: UNAVAILABLE for every
        name when the tier does not answer, and for every name not found in a batch whose
        reads the backend counted errors in (a miss that keeps the object on the books)."""
        p = self.p
        fallback = [ReadResult(None, UNAVAILABLE, 0)] * len(names)
        counters = p.tiers[j].backend.counters
        errors = counters.get_errors
        got = await p.guard.call(j, p.tiers[j].read_into(names, outs, p.pool), fallback, "get")
        failed = counters.get_errors - errors
        gone = sum(r.status == GONE for r in got)
        answering = failed < gone or any(r.status in (HIT, DECLINED) for r in got)
        if answering:
            self._answers[j] += 1
        if failed:
            self.settle_first()  # (clean reads off the loop that ended by now end their names' streaks)
            # A read failed in the backend (a reset connection, a 5xx, EIO): backends answer
            # those as absent, which alone would drop the names from the books (and tell
            # LMCache they were deleted) while their bytes may well be there. A name not
            # found while errors were counted is a miss that keeps it on the books (lower
            # tiers holding a copy are read instead). While the tier answers other reads
            # of the batch (or fails fewer than it did not find), the name's own streak
            # counts, and UNANSWERED_LIMIT reads in a row make it gone; a tier failing
            # everything (away, restarting) keeps every name for as long as it is away.
            got = [self._not_found(j, n, r, answering) if r.status == GONE else self._answered(j, n, r) for n, r in zip(names, got)]
        elif self._unanswered:
            for n, r in zip(names, got):
                self._answered(j, n, r)
        return got

    def answered_off_loop(self, j: int) -> None:
        """From any thread: tier `j` answered a batch read off the loop, all found
        (`kvstore.tiered.direct`), counted as it ends, as `read_tier` counts a batch that
        answered, so a failed read on the loop just after it counts towards its streak."""
        with self._answers_off_lock:  # (worker threads count at once)
            self._answers_off[j] += 1

    def answered(self, j: int, names: Sequence[str]) -> None:
        """Names of tier `j` read off the loop, all found (`kvstore.tiered.direct`'s
        reads, settled after the fact): a streak of failed reads of one of them ends."""
        if self._unanswered:
            for name in names:
                self._unanswered.pop((j, name), None)

    def _answered(self, j: int, name: str, r: ReadResult) -> ReadResult:
        if r.status != UNAVAILABLE:  # (a read the tier did not answer continues a streak)
            self._unanswered.pop((j, name), None)
        return r

    def _not_found(self, j: int, name: str, r: ReadResult, answering: bool) -> ReadResult:
        key = (j, name)
        answers = self._answers[j] + self._answers_off[j]
        now = clock()
        seen, mark, first, last = self._unanswered.get(key, (0, answers, now, now))
        if now - last > UNANSWERED_FORGET_S:  # failures long ago: a new streak
            seen = 0
        if answering or answers > mark:  # the tier answers reads: this object's fail
            if seen == 0:
                first = now
            seen += 1
            if seen >= UNANSWERED_LIMIT and now - first >= UNANSWERED_MIN_S:
                self._unanswered.pop(key, None)
                self.p.metrics.errors.labels("get unreadable", self.p.labels[j]).inc()
                return r  # gone after all
        if key not in self._unanswered and len(self._unanswered) >= 65536:
            del self._unanswered[next(iter(self._unanswered))]  # names never read again: forget the oldest
        self._unanswered[key] = (seen, answers, first, now)
        return ReadResult(None, UNAVAILABLE, 0)

    async def _read_group(
        self,
        src: int,
        group: list[tuple[int, int, int]],
        names: Sequence[str],
        out: Sequence[Out] | None,
        result: list[torch.Tensor | None],
        served: list[bool],
    ) -> None:
        p = self.p
        tier = p.tiers[src]
        sub = [names[i] for i, _, _ in group]
        sub_out = [out[i] for i, _, _ in group] if out is not None else None
        corrupt0 = tier.counters.corrupt
        t0 = time.perf_counter()
        got = await self.read_tier(src, sub, sub_out)
        p.metrics.op_seconds.labels("get", p.labels[src]).observe(time.perf_counter() - t0)
        bad = tier.counters.corrupt - corrupt0
        if bad:
            p.metrics.quarantines.labels(p.labels[src]).inc(bad)
        for (i, placed, mark), (tensor, status, _) in zip(group, got):
            name = names[i]
            at = src
            target = [out[i]] if out is not None else None
            if status == GONE and placed != src:
                # read where its bytes were while a copy was landing; it may just have landed
                tensor, status, _ = (await self.read_tier(placed, [name], target))[0]
            if status == GONE and p.inflight.placements(name, placed) == mark:
                # the engine believed it held: the object is gone (evicted by the backend,
                # maybe for another process's write) or was corrupt: off that tier's books.
                # Unless the name was deleted and placed in that tier anew while this read
                # was under way: the newer object's bytes are not the ones found gone
                p.lost(placed, [name])
            if status in (UNAVAILABLE, GONE):
                # the tier did not answer, or no longer holds it: a lower tier holding a
                # copy may serve it (write-through)
                for k in range(placed + 1, len(p.tiers)):
                    if name in p.placement.tiers[k].resident and not p.guard.refusing(k):
                        tensor, status, _ = (await self.read_tier(k, [name], target))[0]
                        if status == HIT:
                            placed = at = k
                            break
                if status != HIT:
                    continue  # a counted miss (kept on the books while the tier is away)
            if status == DECLINED:
                continue  # still stored: the caller did not take it
            result[i] = tensor
            served[i] = True
            ns = namespace_of(name)
            p.metrics.hits.labels(p.labels[placed], ns).inc()
            p.metrics.bytes_out.labels(p.labels[at], ns).inc(p.placement.tiers[placed].resident.get(name, 0))

    async def _discover(
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
        p = self.p
        for j in range(len(p.tiers)):
            if not todo:
                return
            sub_out = [out[i] for i in todo] if out is not None else None
            got = await self.read_tier(j, [names[i] for i in todo], sub_out)
            still = []
            adopted: list[tuple[str, int]] = []
            for i, (tensor, status, size) in zip(todo, got):
                name = names[i]
                if status in (GONE, UNAVAILABLE):
                    still.append(i)
                    continue
                if self.lookup.discoverable(name):  # nobody stored it meanwhile
                    with p.changing():  # adopting may choose victims
                        moves.extend(p.placement.adopt(name, j, size, p.inflight))
                        p.inflight.placing(name, j)  # (a read of an older object there must not drop it)
                        if p.placement.where(name) is not None and name not in p.book:
                            p.book.add(name, size, now)
                    p.counters.discovered += 1
                    adopted.append((name, size))
                if status == HIT:
                    result[i] = tensor
                    served[i] = True
                    ns = namespace_of(name)
                    p.metrics.hits.labels(p.labels[j], ns).inc()
                    p.metrics.bytes_out.labels(p.labels[j], ns).inc(size)
            for k in range(j + 1, len(p.tiers)):
                if not adopted:
                    break
                held = await p.guard.contains(k, [n for n, _ in adopted])
                for (name, size), h in zip(adopted, held):
                    if h and p.placement.where(name) is not None and not p.inflight.copying(name):
                        with p.changing():
                            moves.extend(p.placement.adopt(name, k, size, p.inflight))
                            p.inflight.placing(name, k)
            todo = still
