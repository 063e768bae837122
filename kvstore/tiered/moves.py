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

    async def carry_out(self, moves: Sequence[Move]) -> None:
        """Drops now (batched per tier); then promotions and demotions in the background.

        Drops go first so that a delete decided before a copy of the same name into the
        same tier can never land after that copy.
        """
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
        await self.delete_each(list(drops.items()), timed=True)
        for ticket in copies:
            self._spawn(self._copy(ticket))
        gone = []
        for m in moves:
            if isinstance(m, Drop) and p.placement.where(m.key) is None:
                p.book.discard(m.key)
                gone.append(m.key)
        p.gone(gone)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        metrics = self.p.metrics
        metrics.moves_in_flight.set(len(self.tasks))

        def done(t: asyncio.Task[None]) -> None:
            self.tasks.discard(t)
            metrics.moves_in_flight.set(len(self.tasks))
            if not t.cancelled() and t.exception() is not None:
                log.error("kvstore: background copy failed", exc_info=t.exception())

        task.add_done_callback(done)

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
        p = self.p
        for j, names in plan:
            self.deleting[j].update(names)

        async def one(j: int, names: Sequence[str]) -> list[bool]:
            try:
                t0 = time.perf_counter()
                held = await (p.guard.delete(j, names) if guarded else p.tiers[j].delete_many(names))
                if timed:
                    p.metrics.op_seconds.labels("delete", p.labels[j]).observe(time.perf_counter() - t0)
                return held
            finally:
                self._deleted_from(j, names)

        return list(await asyncio.gather(*(one(j, names) for j, names in plan)))

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
        `j` is under way: one decided before these bytes were planned must not land after
        them (the books would hold a name its medium lost: a counted miss later)."""
        deleting = self.deleting[j]
        if await self._until(lambda: not any(name in deleting for name in names)):
            return
        # a delete outlasting the tier's deadline: the write goes on (a store must not stall),
        # counted, and if that delete lands after it the read is a counted miss
        self.p.metrics.errors.labels("write after a slow delete", self.p.labels[j]).inc()
        log.warning("kvstore: %s: a delete of a name being written again is still under way", self.p.labels[j])

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

    async def _copy(self, ticket: Ticket) -> None:
        """One promotion or demotion.  Copies of one name run one at a time (in order);
        the source stays readable until the name's last copy is done."""
        p = self.p
        m = ticket.copy
        assert m is not None
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_moves)
        try:
            if m.kind == "promote" and m.key in p.placement.tiers[m.dst].resident:
                await self.room(m.dst, promoting=True)  # into a full tier: after the demotions out of it
            async with p.inflight.turn(ticket, self._sem) as src:
                await self._copy_into(m, src)
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

    async def _copy_into(self, m: Copy, src: int) -> None:
        p = self.p
        name, dst = m.key, m.dst
        if name not in p.placement.tiers[dst].resident:
            return  # evicted again before the copy started
        if not await self._copy_bytes(name, src, dst):
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

    async def _copy_bytes(self, name: str, src_i: int, dst_i: int) -> bool:
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
                try:
                    parts = src.transcode(frame, name, dst.codec)
                except (FrameError, ValueError):
                    p.metrics.errors.labels("copy", p.labels[src_i]).inc()
                    return False
            await self.settled(dst_i, [name])  # after a delete of the name there decided earlier
            ok = (await dst.put_frames([(name, parts)]))[0]  # every backend is done with the buffer here
        finally:
            for buf in taken:
                p.pool.give(buf)
        p.metrics.op_seconds.labels("copy", p.labels[dst_i]).observe(time.perf_counter() - t0)
        if not ok:
            p.metrics.errors.labels("put", p.labels[dst_i]).inc()
        return ok
