"""Carrying out the placement engine's moves: drops now, copies in the background.

Owns: `Mover`: executing `Drop` and `Copy` moves (`kvstore.policy.engine`) over real
tiers, the background copy tasks and their concurrency bound (`max_moves`), the bytes of
a copy (read as verified frames, transcoded by the source tier when the destination's
codec differs), cleanup after a name's last copy, and telling `on_gone` which names
left every tier.  Also the bytes still on a tier's medium that its books no longer
count (a demotion's source, a drop waiting for a copy) until that copy is done, and
`room`: a write or promotion into a full tier waits for them to go, so the engine's
demotions (which never wait), not the backend's own eviction, make the room; and the
deletes under way per tier (`settled`): a write of a name waits for a delete of it
decided earlier, so that delete cannot land on the new bytes.  Must not touch: placement
rules (the engine decided the moves), tensor decoding (`Tier`), foreground writes and
reads (`writes`, `reads`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvstore.frame import FrameError
from kvstore.keys import printable_name
from kvstore.namespaces import namespace_of
from kvstore.policy import Copy, Drop, Move
from kvstore.tiered.inflight import Ticket
from kvstore.tiered.parts import Parts

log = logging.getLogger(__name__)

ROOM_WAIT_S = 5.0  # longest a write waits for demotions to leave a full tier (without a tier deadline)


class Mover:
    """Drops and copies for one store; see the module docstring."""

    def __init__(self, parts: Parts, max_moves: int) -> None:
        self.p = parts
        self.max_moves = max_moves
        self.tasks: set[asyncio.Task[None]] = set()
        self._sem: asyncio.Semaphore | None = None
        # per tier: names whose bytes stay on its medium after the books let them go -> bytes
        self.leaving: list[dict[str, int]] = [{} for _ in parts.tiers]
        self._changed = asyncio.Event()  # set (and replaced) whenever bytes leave or a delete is done
        self.promoting: Counter[str] = Counter()  # promotions not yet done, per name
        # per tier: names with a delete of ours under way (decided, not yet done) -> how many;
        # a write or copy of such a name into that tier waits for them (`settled`), so a
        # delete decided before the name was stored again cannot land after its bytes
        self.deleting: list[Counter[str]] = [Counter() for _ in parts.tiers]
        # per tier: names a copy is writing there now; a foreground write of such a name
        # waits for it (`settled`), so the object before cannot land over the new one
        self.copying_into: list[Counter[str]] = [Counter() for _ in parts.tiers]

    def begin(self, moves: Sequence[Move]) -> asyncio.Task[Any] | None:
        """Carry out the engine's moves, all bookkeeping now (in one step, so a caller
        cancelled afterwards cannot leave it half done: a copy decided and never run
        would hold its name's tickets and its source's room forever): the drops are
        marked under way and sent on a task of their own (batched per tier), the copies
        start in the background (a copy into a tier waits for the drops of its name from
        there decided before it: `settled`), and names no tier keeps are announced gone.
        The copies begin once the drops are over: the room a demotion lands in is the room
        the plan's drops make (else a tier's backend would evict to make it).
        Returns the drops' task, for `finish` (None: no drops)."""
        p = self.p
        drops: dict[int, list[str]] = {}
        copies: list[Ticket] = []
        for m in moves:
            if isinstance(m, Drop):
                if not p.inflight.copying(m.key):
                    drops.setdefault(m.src, []).append(m.key)
                else:  # a copy may be reading it; the name's last copy cleans up
                    self.leaving[m.src][m.key] = m.size
                p.metrics.evictions.labels(p.labels[m.src]).inc()
            elif isinstance(m, Copy):
                if m.kind == "demote":
                    p.metrics.evictions.labels(p.labels[m.src]).inc()
                    self.leaving[m.src][m.key] = m.size
                else:
                    self.promoting[m.key] += 1
                copies.append(p.inflight.prepare_copy(m))  # until it lands, read it where its bytes are
        plan = list(drops.items())
        self._mark(plan)
        sending = self._spawn(self._send(plan, guarded=True, timed=True)) if plan else None
        for ticket in copies:
            self._spawn(self._copy(ticket, sending))
        gone = []
        for m in moves:
            if isinstance(m, Drop) and p.placement.where(m.key) is None:
                p.book.discard(m.key)
                gone.append(m.key)
        p.gone(gone)
        return sending

    async def finish(self, sending: asyncio.Task[Any] | None) -> None:
        """Wait for the drops `begin` sent; a cancelled caller stops waiting, the drops
        go on (`drain` waits for them)."""
        if sending is not None:
            await asyncio.shield(sending)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        metrics = self.p.metrics
        metrics.moves_in_flight.set(len(self.tasks))

        def done(t: asyncio.Task[Any]) -> None:
            self.tasks.discard(t)
            metrics.moves_in_flight.set(len(self.tasks))
            if not t.cancelled() and t.exception() is not None:
                log.error("kvstore: background move failed", exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def room(self, j: int, promoting: bool = False) -> None:
        """Wait (a bounded time) until tier `j`'s books plus the bytes still leaving it fit
        its capacity, so a write there does not make the backend evict.  Demotions never
        wait.  Not waited for: bytes of names whose foreground write has not landed (their
        copies wait for that write) and, by a promotion, bytes of names being promoted
        (their promotions may be waiting too)."""
        p = self.p
        tier = p.placement.tiers[j]
        if not self.leaving[j] or p.tiers[j].backend.capacity is None:
            return  # nothing leaving, or no backend budget that could evict

        def fits() -> bool:
            leaving = sum(
                n
                for k, n in self.leaving[j].items()
                if not p.inflight.landing_write(k) and not (promoting and k in self.promoting)
            )
            return tier.used + leaving <= tier.capacity

        await self._until(fits)

    async def _until(self, ready: Callable[[], bool]) -> bool:
        """Wait until `ready()` (asked again whenever bytes leave a tier or a delete is
        over), at most the tier deadline (`ROOM_WAIT_S` without one); whether it is."""
        deadline = time.monotonic() + (self.p.guard.timeout or ROOM_WAIT_S)
        while not ready():
            wait = deadline - time.monotonic()
            if wait <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except asyncio.TimeoutError:
                return ready()
        return True

    async def delete_each(
        self, plan: Sequence[tuple[int, Sequence[str]]], *, guarded: bool = True, timed: bool = False
    ) -> list[list[bool]]:
        """Delete `names` from tier `j` for each (j, names) of `plan`, every tier at once.
        All of them are marked under way before the first is sent (no write of those names
        into those tiers starts meanwhile: `settled`), each until its own delete is over."""
        self._mark(plan)
        return await self._send(plan, guarded=guarded, timed=timed)

    def _mark(self, plan: Sequence[tuple[int, Sequence[str]]]) -> None:
        for j, names in plan:
            self.deleting[j].update(names)

    async def _send(
        self, plan: Sequence[tuple[int, Sequence[str]]], *, guarded: bool, timed: bool
    ) -> list[list[bool]]:
        """The deletes `_mark` marked, every tier at once; each mark is lifted when its
        delete is over, or when this is cancelled (also before that delete began)."""
        p = self.p
        over = [False] * len(plan)

        def lift(k: int) -> None:
            if not over[k]:
                over[k] = True
                self._deleted_from(*plan[k])

        async def one(k: int) -> list[bool]:
            j, names = plan[k]
            try:
                t0 = time.perf_counter()
                held = await (p.guard.delete(j, names) if guarded else p.tiers[j].delete_many(names))
                if timed:
                    p.metrics.op_seconds.labels("delete", p.labels[j]).observe(time.perf_counter() - t0)
                return held
            finally:
                lift(k)

        try:
            return list(await asyncio.gather(*(one(k) for k in range(len(plan)))))
        finally:
            for k in range(len(plan)):
                lift(k)

    async def delete(self, j: int, names: Sequence[str], *, guarded: bool = True) -> list[bool]:
        """`delete_each` for one tier."""
        return (await self.delete_each([(j, names)], guarded=guarded))[0]

    def _deleted_from(self, j: int, names: Sequence[str]) -> None:
        deleting = self.deleting[j]
        for name in names:
            deleting[name] -= 1
            if deleting[name] <= 0:
                del deleting[name]
        self._wake()

    async def settled(self, j: int, names: Sequence[str]) -> None:
        """Wait (a bounded time, as `room`) until no delete of ours of `names` from tier
        `j` is under way, nor a copy's write of them into it: a delete decided before
        these bytes were planned must not land after them (the books would hold a name
        its medium lost: a counted miss later), nor a copy of the object before (a
        promotion or demotion decided before the name was written anew)."""
        deleting, copying = self.deleting[j], self.copying_into[j]
        if await self._until(lambda: not any(name in deleting or name in copying for name in names)):
            return
        # a delete outlasting the tier's deadline: the write goes on (a store must not stall),
        # counted, and if that delete lands after it the read is a counted miss
        self.p.metrics.errors.labels("write after a slow delete", self.p.labels[j]).inc()
        log.warning(
            "kvstore: %s: a delete or copy of a name being written again is still under way", self.p.labels[j]
        )

    def _gone_from_media(self, name: str) -> None:
        """`name`'s last copy is done: no medium keeps bytes of it that the books let go."""
        for leaving in self.leaving:
            leaving.pop(name, None)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def drain(self) -> None:
        """Wait until every background copy has finished."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _copy(self, ticket: Ticket, after: asyncio.Task[Any] | None = None) -> None:
        """One promotion or demotion, once the drops `after` are over.  Copies of one name
        run one at a time (in order); the source stays readable until the name's last
        copy is done."""
        p = self.p
        m = ticket.copy
        assert m is not None
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_moves)
        try:
            if after is not None:
                await asyncio.wait({after})
            if m.kind == "promote" and m.key in p.placement.tiers[m.dst].resident:
                await self.room(m.dst, promoting=True)  # into a full tier: after the demotions out of it
            async with p.inflight.turn(ticket, self._sem) as src:
                if not p.inflight.stale(ticket):  # (else written anew since: the old bytes stay out)
                    await self._copy_into(m, src, ticket)
        finally:
            if m.kind == "promote":
                self.promoting[m.key] -= 1
                if self.promoting[m.key] <= 0:
                    del self.promoting[m.key]
                self._wake()  # a write may have waited for this name's bytes
            if p.inflight.complete(ticket):
                # the name's last copy is done: no tier keeps bytes the engine does not count
                # (a demotion's source, a promotion's source evicted meanwhile, drops that waited)
                stale = [j for j, st in enumerate(p.placement.tiers) if m.key not in st.resident]
                try:
                    await self.delete_each([(j, [m.key]) for j in stale], guarded=False)
                finally:
                    self._gone_from_media(m.key)
            p.update_gauges()

    async def _copy_into(self, m: Copy, src: int, ticket: Ticket) -> None:
        p = self.p
        name, dst = m.key, m.dst
        if name not in p.placement.tiers[dst].resident:
            return  # evicted again before the copy started
        ok = await self._copy_bytes(name, src, dst, ticket)
        if ok is None:
            return  # written anew while it was read: not copied
        if not ok:
            if (await p.tiers[dst].contains_many([name]))[0]:
                return  # an earlier copy of the same name has landed it
            if p.forget(name, dst):
                # A demotion whose copy failed: the source gave the name up when the move
                # was planned (an object took its room there), so it leaves the store, as an
                # eviction from the last tier does. Counted (the copy's error) and announced,
                # so no caller goes on promising it; its source bytes go with the name's
                # last copy, as for every name no tier keeps.
                log.warning(
                    "kvstore: %s could not be moved to %s (its copy failed); it leaves the store: "
                    "the next read of it is a miss",
                    printable_name(name),
                    p.labels[dst],
                )
                p.gone([name])
            return
        p.metrics.moves.labels(m.kind, p.labels[dst]).inc()
        p.metrics.bytes_in.labels(p.labels[dst], namespace_of(name)).inc(m.size)
        if name not in p.placement.tiers[dst].resident:
            await self.delete(dst, [name], guarded=False)  # evicted while copying

    async def _copy_bytes(self, name: str, src_i: int, dst_i: int, ticket: Ticket) -> bool | None:
        """Copy `name`'s frame from tier `src_i` into `dst_i`: whether it landed; None when
        the name was written anew meanwhile (`InFlight.stale`: the old bytes stay out)."""
        p = self.p
        src, dst = p.tiers[src_i], p.tiers[dst_i]
        taken: list[bytearray] = []

        def alloc(n: int) -> memoryview:  # pooled: a fresh multi-MiB buffer costs page faults
            taken.append(p.pool.take(n))
            return memoryview(taken[-1])

        t0 = time.perf_counter()
        try:
            frame = (await src.get_frames([name], alloc))[0]
            if frame is None:
                p.metrics.errors.labels("copy", p.labels[src_i]).inc()
                return False
            if frame.header.codec == dst.codec.name:
                parts = [memoryview(taken[-1])]  # the verified frame as read, byte for byte
            else:
                try:  # (decode and encode: on a worker thread, the loop serves on)
                    parts = await asyncio.to_thread(src.transcode, frame, name, dst.codec)
                except (FrameError, ValueError):
                    p.metrics.errors.labels("copy", p.labels[src_i]).inc()
                    return False
            await self.settled(dst_i, [name])  # after a delete of the name there decided earlier
            if p.inflight.stale(ticket):
                return None
            self.copying_into[dst_i][name] += 1  # (a write of the name anew there waits: `settled`)
            undo = put = False
            try:
                ok = (await dst.put_frames([(name, parts)]))[0]  # every backend is done with the buffer here
                put = True
            finally:
                if put and p.inflight.stale(ticket):
                    # written anew while this copy wrote (a write that waited past its bound):
                    # the old bytes must not stay where the books count the new ones; the
                    # delete is marked before the write is woken, so it lands first
                    undo = True
                    self._mark([(dst_i, [name])])
                self.copying_into[dst_i][name] -= 1
                if self.copying_into[dst_i][name] <= 0:
                    del self.copying_into[dst_i][name]
                self._wake()
            if undo:
                p.metrics.errors.labels("copy of a name written anew", p.labels[dst_i]).inc()
                await self._send([(dst_i, [name])], guarded=False, timed=False)
                return None
        finally:
            for buf in taken:
                p.pool.give(buf)
        p.metrics.op_seconds.labels("copy", p.labels[dst_i]).observe(time.perf_counter() - t0)
        if not ok:
            p.metrics.errors.labels("put", p.labels[dst_i]).inc()
        return ok
