"""Carrying out the placement engine's moves: drops now, copies in the background.

Owns: `Mover`: executing `Drop` and `Copy` moves (`kvstore.policy.engine`) over real
tiers, the background copy tasks and their concurrency bound (`max_moves`), the bytes of
a copy (read as verified frames, transcoded by the source tier when the destination's
codec differs), cleanup after a name's last copy, and telling `on_gone` which names
left every tier.  Must not touch: placement rules (the engine decided the moves), tensor
decoding (`Tier`), foreground writes and reads (`writes`, `reads`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvstore.frame import FrameError
from kvstore.namespaces import namespace_of
from kvstore.policy import Copy, Drop, Move
from kvstore.tiered.inflight import Ticket
from kvstore.tiered.parts import Parts

log = logging.getLogger(__name__)


class Mover:
    """Drops and copies for one store; see the module docstring."""

    def __init__(self, parts: Parts, max_moves: int) -> None:
        self.p = parts
        self.max_moves = max_moves
        self.tasks: set[asyncio.Task[None]] = set()
        self._sem: asyncio.Semaphore | None = None
        # called with the names that left every tier (evicted or deleted)
        self.on_gone: Callable[[list[str]], None] | None = None

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
                # else: a copy may be reading it; the name's last copy cleans up
                p.metrics.evictions.labels(p.labels[m.src]).inc()
            elif isinstance(m, Copy):
                if m.kind == "demote":
                    p.metrics.evictions.labels(p.labels[m.src]).inc()
                copies.append(p.inflight.prepare_copy(m))  # until it lands, read it where its bytes are
        for j, keys in drops.items():
            t0 = time.perf_counter()
            await p.guard.delete(j, keys)
            p.metrics.op_seconds.labels("delete", p.labels[j]).observe(time.perf_counter() - t0)
        for ticket in copies:
            self._spawn(self._copy(ticket))
        gone = []
        for m in moves:
            if isinstance(m, Drop) and p.placement.where(m.key) is None:
                p.book.discard(m.key)
                gone.append(m.key)
        if gone and self.on_gone is not None:
            try:
                self.on_gone(gone)
            except Exception:
                log.exception("kvstore: on_gone callback failed")

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
            async with p.inflight.turn(ticket, self._sem) as src:
                await self._copy_into(m, src)
        finally:
            if p.inflight.complete(ticket):
                # the name's last copy is done: no tier keeps bytes the engine does not count
                # (a demotion's source, a promotion's source evicted meanwhile, drops that waited)
                stale = [j for j, st in enumerate(p.placement.tiers) if m.key not in st.resident]
                for j in stale:
                    await p.tiers[j].delete_many([m.key])
            p.update_gauges()

    async def _copy_into(self, m: Copy, src: int) -> None:
        p = self.p
        name, dst = m.key, m.dst
        if name not in p.placement.tiers[dst].resident:
            return  # evicted again before the copy started
        if not await self._copy_bytes(name, src, dst):
            if (await p.tiers[dst].contains_many([name]))[0]:
                return  # an earlier copy of the same name has landed it
            p.forget(name, dst)
            return
        p.metrics.moves.labels(m.kind, p.labels[dst]).inc()
        p.metrics.bytes_in.labels(p.labels[dst], namespace_of(name)).inc(m.size)
        if name not in p.placement.tiers[dst].resident:
            await p.tiers[dst].delete_many([name])  # evicted while copying

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
            ok = (await dst.put_frames([(name, parts)]))[0]  # every backend is done with the buffer here
        finally:
            for buf in taken:
                p.pool.give(buf)
        p.metrics.op_seconds.labels("copy", p.labels[dst_i]).observe(time.perf_counter() - t0)
        if not ok:
            p.metrics.errors.labels("put", p.labels[dst_i]).inc()
        return ok
