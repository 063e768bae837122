"""Reads whose whole path stays off the event loop: a batch one disk tier holds, streamed
into the callers' tensors on worker threads started from the caller's thread, and
answered from the thread that finished last.

Owns: `DirectReads`: whether a batch can be read this way (decided on the caller's
thread from the books, under their seqlock, as `Lookup.known` does), the worker threads
that read it (at most the tier's read concurrency, and no more than this process has
CPUs), and the batch's bookkeeping (hits, LRU touches, promotions, metrics), sent to the
loop once the caller has its answer.  Must not touch: anything but a clean hit.  A miss,
a defect, a frame to decode, a target that does not fit: the whole batch is then left
to the regular read path (`kvstore.tiered.reads.Reader`), which counts, quarantines and
reads lower tiers, and the direct read leaves no trace on the books.

Why: a page-cache-warm load of a few 5.6 MiB chunks on a two-core machine spent about as
long in hops (the caller's thread to the loop, the loop to the disk workers, and back)
and in the loop's steps between them as in its copies.  Here the caller's thread hands
the reads to the workers, and the last worker answers the caller.

What a direct read checks is what a streamed read checks (`kvstore.frame_sink`: the key,
the length, the checksum, the shape and dtype against the target).  A name the books
place in one tier, with no write, copy or landing of it under way, is read from that
tier's file; a file deleted or replaced meanwhile is a failed step (the regular path
then decides) or the whole object of the same key that replaced it, verified as any
other.  Only raw frames are read this way (a codec's frames decode on the loop's path).

Bookkeeping: a batch's hits go on the books (LRU touches, counters, metrics,
promotions) on the loop, gathered for up to `SETTLE_S` and kept in one pass: one wake of
the loop per pass rather than one per batch, whose steps on a two-core machine competed
with the next batch's copies.  `settle_pending` keeps what has gathered now: every
operation of the store on the loop calls it first (a victim chosen then sees the hits;
a failed read's streak sees the clean reads before it), as do `drain`, `stats` and
`close`.  A tier's answer, which those streaks count, is counted as each batch ends.

Deadlines: a batch past the tier's deadline begins no more objects and is handed back,
and while one is still reading past it every later batch goes the regular way, whose
deadline and breaker take it from there.  `close` stops every batch the same way and
waits only for the objects under way.  These reads do not take the disk tier's own
read slots (its ``concurrency``): a load off the loop and one on it may read at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.namespaces import namespace_of
from kvstore.policy import NO_META, Move
from kvstore.tier_stream import StreamTargets, Target

if TYPE_CHECKING:
    from kvstore.backends.base import ReadsNow, ReadStep
    from kvstore.tiered.lookup import Lookup
    from kvstore.tiered.moves import Mover
    from kvstore.tiered.parts import Parts
    from kvstore.tiered.reads import Reader

log = logging.getLogger(__name__)

_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SETTLE_S = 0.02  # the longest a batch's hits wait to go on the books (gathered into one pass)

#: told the payload bytes of every name (all read, verified, in their targets), or None:
#: nothing usable was read, the regular path must read the batch (it is the caller's)
Done = Callable[[list[int] | None], None]


class _Batch:
    """One direct read: items taken from one queue by its worker jobs."""

    def __init__(
        self, j: int, names: Sequence[str], outs: Sequence[Target], step: ReadStep, done: Done, jobs: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.j = j
        self.loop = loop
        self.names = list(names)
        self.reads = StreamTargets(outs)
        self.sinks = self.reads.sinks(names)
        self.step = step
        self.done = done
        # per object read clean: (object size, bytes read, payload bytes); None otherwise
        self.found: list[tuple[int, int, int] | None] = [None] * len(names)
        self.queue: deque[int] = deque(range(len(names)))
        self.jobs = jobs
        self.started = time.monotonic()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        """Begin no more objects (those under way finish: they write into the targets)."""
        self.reads.stopped = True
        self.queue.clear()


class DirectReads:
    """See the module docstring.  `start` on any thread; `close` on the loop."""

    def __init__(self, parts: Parts, lookup: Lookup, reader: Reader, mover: Mover) -> None:
        self.p = parts
        self.lookup = lookup
        self.reader = reader
        self.mover = mover
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._under_way: set[_Batch] = set()
        # clean batches whose bookkeeping waits for the loop: (tier, names, sizes, bytes read, seconds)
        # (a pass is scheduled on the loop while this is not empty)
        self._settles: list[tuple[int, list[str], list[int], list[int], float]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop passes run on
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    # -- on the caller's thread ------------------------------------------------------------
    def start(self, names: Sequence[str], outs: Sequence[Target], done: Done, loop: asyncio.AbstractEventLoop) -> bool:
        """Read `names` into `outs` off the loop and call `done` from a worker thread;
        False (nothing started, `done` never called) when the batch must go the regular
        way: not every name placed in the same tier and settled there, that tier not one
        whose reads can run off the loop, its breaker not closed, or the books changing
        while they were read.  `loop` is the store's (the bookkeeping runs there)."""
        plan = self._plan(names)
        if plan is None:
            return False
        j, reads = plan
        workers = max(1, min(reads.concurrency, _CPUS))
        batch = _Batch(j, names, outs, reads.step, done, min(workers, len(names)), loop)
        with self._lock:
            if self._closed or self._overdue():
                return False
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-read")
            pool = self._pool
            self._under_way.add(batch)
        for _ in range(batch.jobs):
            try:
                pool.submit(self._job, batch)
            except RuntimeError:  # the interpreter is shutting down: this job never runs
                self._job_ended(batch)
        return True

    def _plan(self, names: Sequence[str]) -> tuple[int, ReadsNow] | None:
        """The tier holding every name, and its reads off the loop; None: the regular path."""
        p = self.p
        if self._closed or not names:
            return None
        stamp = p.stamp()
        if stamp is None:
            return None
        now = p.clock()
        inflight = p.inflight
        j: int | None = None
        for name in names:
            t = self.lookup.visible(name, now)
            if t is None or (j is not None and t != j) or inflight.busy(name) or inflight.source(name, t) != t:
                return None
            j = t
        assert j is not None
        if not p.guard.available(j) or p.tiers[j].codec.name != "raw":  # (a codec decodes on the loop's path)
            return None
        reads = p.tiers[j].backend.reader_now()
        if reads is None or not p.unchanged_since(stamp):
            return None
        return j, reads

    def _overdue(self) -> bool:
        """A batch has been reading for longer than a tier's deadline (under the lock)."""
        timeout = self.p.guard.timeout
        if timeout is None or not self._under_way:
            return False
        now = time.monotonic()
        return any(now - b.started > timeout for b in self._under_way)

    # -- on the worker threads -------------------------------------------------------------
    def _job(self, batch: _Batch) -> None:
        reads = batch.reads
        timeout = self.p.guard.timeout
        try:
            while True:
                try:
                    k = batch.queue.popleft()  # atomic: two jobs never take the same item
                except IndexError:
                    return
                if timeout is not None and time.monotonic() - batch.started > timeout:
                    batch.stop()  # past the tier's deadline: the regular path's deadline and breaker decide
                    return
                try:
                    size, got, verdict = batch.step(batch.names[k], batch.sinks[k])
                except Exception:  # the regular path reads it again and says what it is
                    batch.stop()
                    return
                plen = reads.clean(k, batch.sinks[k], verdict)
                if plen is None:  # not a clean hit: the batch is the regular path's
                    batch.stop()
                    return
                batch.found[k] = (size, got, plen)
        finally:
            self._job_ended(batch)

    def _job_ended(self, batch: _Batch) -> None:
        with self._lock:
            batch.jobs -= 1
            if batch.jobs:
                return
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        """The last job's end: answer the caller, then send the bookkeeping to the loop."""
        found = [f for f in batch.found if f is not None]
        ok = len(found) == len(batch.found)
        try:
            if ok:  # gathered before the caller hears, so a close waiting for this batch keeps it
                self._gather(batch, [f[0] for f in found], [f[1] for f in found])
            try:
                batch.done([f[2] for f in found] if ok else None)
            except Exception:
                log.exception("kvstore: a direct read's caller failed on its answer")
        finally:
            with self._lock:
                self._under_way.discard(batch)
                if not self._under_way:
                    self._idle.notify_all()

    def _gather(self, batch: _Batch, sizes: list[int], got: list[int]) -> None:
        """Keep a clean batch's bookkeeping for the loop's next pass (scheduled if none is)."""
        entry = (batch.j, batch.names, sizes, got, time.perf_counter() - batch.t0)
        self.reader.answered_off_loop(batch.j)  # (now: failed reads on the loop meanwhile count)
        with self._lock:
            scheduled = bool(self._settles)
            self._settles.append(entry)
            self._loop = batch.loop
        if scheduled:
            return
        try:
            batch.loop.call_soon_threadsafe(batch.loop.call_later, SETTLE_S, self.settle_pending)
        except RuntimeError:  # the loop is closed: nothing keeps books any more
            pass

    # -- on the loop -----------------------------------------------------------------------
    def settle_pending(self) -> None:
        """Put the hits of the batches that have ended on the books now.  On the loop
        (called anywhere else it does nothing: the pass already scheduled keeps them)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self._lock:
            if self._loop is not None and running is not self._loop:
                return
            todo, self._settles = self._settles, []
        if todo:
            try:
                self._settle(todo)
            except Exception:  # the reads were answered: only their bookkeeping is lost
                log.exception("kvstore: keeping the books of %d read(s) off the loop failed", len(todo))

    def _settle(self, todo: list[tuple[int, list[str], list[int], list[int], float]]) -> None:
        """What a regular read does to the books after a hit: the backend's (sizes, LRU),
        the reader's (the tier answered: failed-read streaks), the tier's and the store's
        counters and metrics, the engine's hit (promotions)."""
        p = self.p
        moves: list[Move] = []
        with p.changing():  # a hit may promote, and so choose victims: one stretch
            for j, names, sizes, got, seconds in todo:
                tier = p.tiers[j]
                tier.backend.read_off_loop(names, sizes, got)
                tier.counters.hits += len(names)
                label = p.labels[j]
                p.metrics.op_seconds.labels("get", label).observe(seconds)
                self.reader.answered(j, names)  # (their own streaks end)
                resident = p.placement.tiers[j].resident
                for name in names:
                    ns = namespace_of(name)
                    p.metrics.hits.labels(label, ns).inc()
                    p.metrics.bytes_out.labels(label, ns).inc(resident.get(name, 0))
                    moves.extend(p.placement.hit(name, NO_META, p.inflight))
            self.mover.begin(moves)  # its tasks are the mover's: `drain` waits for them
        p.update_gauges()

    async def close(self) -> None:
        """Start no more batches; stop the ones under way (their objects not begun are
        never read: they are handed back) and wait for the objects under way (they write
        into their callers' tensors, which may be freed once the store is closed)."""
        with self._lock:
            self._closed = True
            busy = bool(self._under_way)
            for batch in self._under_way:
                batch.stop()
            pool, self._pool = self._pool, None
        if busy:
            await asyncio.to_thread(self._wait_idle)
        # the bookkeeping of batches that ended (gathered before they did) is kept before
        # the store drains its moves and closes its tiers
        self.settle_pending()
        if pool is not None:
            pool.shutdown(wait=False)

    def _wait_idle(self) -> None:
        with self._idle:
            while self._under_way:
                self._idle.wait()


__all__ = ["SETTLE_S", "DirectReads", "Done"]
