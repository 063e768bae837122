"""The write path of a TieredStore: the caller's data into the tiers the engine chose.

Owns: `Writer`: framing each tensor once for the top tier (large ones on worker
threads, their checksums left to the tiers' writes; again only for a tier whose codec
differs), namespace quotas, asking the engine where each object goes (with
its place in a prefix chain), sending a name the same plan evicts again straight to
where the plan leaves it, then writing one batch per tier in the foreground under
the tier's guard (after the demotions out of a full tier have made room, see
`Mover.room`); a write becomes visible only once it has landed, and one that failed
is taken off the books.  Must not touch: reads, the engine's rules, background copies
(handed to `Mover`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.frame import seal_frames
from kvstore.keys import InvalidKeyError, check_object_name
from kvstore.namespaces import namespace_of
from kvstore.policy import NO_META, AnyOf, ChunkMeta, Copy, Drop, Move, Write, WriteBatch
from kvstore.tiered.inflight import Ticket
from kvstore.tiered.moves import Mover
from kvstore.tiered.parts import Parts

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Writer:
    def __init__(self, parts: Parts, mover: Mover) -> None:
        self.p = parts
        self.mover = mover

    async def put_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        chained: bool,
        parent: str | None,
        layout: str,
        now: float,
    ) -> list[bool]:
        p = self.p
        results = [False] * len(items)
        frames = await self._frames(items, layout)

        # decide everything first (synchronously: no other task sees a half-made plan,
        # and a reader on another thread knows one is being made: `Parts.changing`)
        with p.changing():
            ticket, writes, moves = self._plan(items, frames, results, chained, parent, now)
            # (now: a cancel later must not leave the moves half done; in the stretch: a
            # copy's landing marks go with its placing)
            sending = self.mover.begin(moves)

        by_tier: dict[int, list[tuple[int, Write]]] = {}
        for i, w in writes:
            by_tier.setdefault(w.dst, []).append((i, w))
        reported: set[tuple[str, int]] = set()  # (name, tier) writes whose outcome is on the books
        try:  # (completing the ticket however this ends: else its names stay invisible)
            await self._seal_shared(frames, writes)
            await self.mover.finish(sending)
            # the caller's data: written in the foreground, one batch per tier
            await asyncio.gather(
                *(
                    self._write_tier(j, b, items, frames, layout, results, ticket, reported)
                    for j, b in by_tier.items()
                )
            )
        except asyncio.CancelledError:
            self._unreported(writes, reported)
            raise
        finally:
            p.inflight.complete(ticket)
        for name, _ in items:
            if p.placement.where(name) is None:
                p.book.discard(name)
        p.update_gauges()
        return results

    def _plan(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        frames: list[list[memoryview] | None],
        results: list[bool],
        chained: bool,
        parent: str | None,
        now: float,
    ) -> tuple[Ticket, list[tuple[int, Write]], list[Move]]:
        """Where each framed item goes: the engine's decisions, quota evictions, the
        writes marked in flight (a name already held is a touch: `results` True)."""
        p = self.p
        protected = p.inflight
        placed = WriteBatch()  # the names planned so far: none makes room for a later one
        keep = AnyOf(protected, placed)
        if chained and parent is not None:  # nor does the prefix the batch continues (quotas)
            keep = AnyOf(keep, self._ancestors(parent))
        steps: list[tuple[int, Write] | Move] = []  # writes (item, Write) and moves, in plan order
        prev_meta = p.placement.meta.get(parent, NO_META) if parent is not None else NO_META
        prev = parent
        ticket = p.inflight.prepare_write()
        for i, (name, _) in enumerate(items):
            parts = frames[i]
            if parts is None:
                continue
            size = sum(part.nbytes for part in parts)
            if chained:
                depth = prev_meta.depth + 1 if prev is not None else 0
                meta = ChunkMeta(depth=depth, parent=prev, tail=i == len(items) - 1)
                prev, prev_meta = name, meta
            else:
                meta = NO_META
            if p.placement.where(name) is None:
                room = p.book.over_quota(name, size, keep=keep)
                if room is None:
                    p.metrics.errors.labels("quota", "-").inc()
                    continue
                for old in room:
                    steps.extend(p.placement.delete(old))
                    p.metrics.quota_evictions.labels(namespace_of(old)).inc()
                    p.book.discard(old)
            else:
                results[i] = True  # already held: the store call is a touch
            for m in p.placement.store(name, size, meta, protected, placed):
                if name not in p.book:
                    p.book.add(name, size, now)  # reserved now: later items see the quota
                steps.append((i, m) if isinstance(m, Write) else m)
        writes, moves = self._shortest_way(steps)
        for _, w in writes:
            p.inflight.replaced(w.key)  # (copies of it under way carry the object before)
            p.inflight.add_write(ticket, w.key)
            p.inflight.placing(w.key, w.dst)
        return ticket, writes, moves

    async def _seal_shared(
        self, frames: list[list[memoryview] | None], writes: list[tuple[int, Write]]
    ) -> None:
        """Seal now the unsealed frames this plan writes into more than one tier (on worker
        threads, all at once): else the tier whose write claims one first (a disk or
        Redis tier hashing as it writes) would hold the others' writes of it until it is done."""
        times = Counter(i for i, _ in writes)
        await seal_frames(frames[i] for i, n in times.items() if n > 1)

    def _unreported(self, writes: list[tuple[int, Write]], reported: set[tuple[str, int]]) -> None:
        """The caller gave up (its deadline) before these writes' outcomes came back: off
        the books, as failed writes (counted), so no lookup promises them and a store of
        the name again writes it (else it would be a touch of bytes that may not be
        there).  A write that lands anyway is bytes the books do not count; a store that
        discovers finds it."""
        p = self.p
        with p.changing():
            for _, w in writes:
                if (w.key, w.dst) not in reported:
                    p.metrics.errors.labels("put cancelled", p.labels[w.dst]).inc()
                    p.placement.forget(w.key, w.dst)
                    if p.placement.where(w.key) is None:
                        p.book.discard(w.key)

    def _ancestors(self, name: str) -> set[str]:
        """`name` and the chunks before it in its prefix chain, as far as the books know."""
        meta = self.p.placement.meta
        out: set[str] = set()
        key: str | None = name
        while key is not None and key not in out:
            out.add(key)
            key = meta.get(key, NO_META).parent
        return out

    async def _frames(
        self, items: Sequence[tuple[str, torch.Tensor]], layout: str
    ) -> list[list[memoryview] | None]:
        """Each item framed for the top tier (None: an invalid name), large ones on worker
        threads, all at once (`Tier.encode_off_loop`): the event loop goes on serving
        other reads and writes meanwhile, and a batch's codecs run on every core instead
        of one after another on the loop's.  Large frames are left unsealed: each tier's
        `Tier.put_frames` computes the checksum, on worker threads, or a disk or Redis
        tier while it writes or sends the payload (one pass over it instead of two).
        Frames made without a worker thread (`Tier.encode_now`) are made here, with no
        task each."""
        top = self.p.tiers[0]
        frames: list[list[memoryview] | None] = [None] * len(items)
        later: list[int] = []
        for i, (name, tensor) in enumerate(items):
            try:
                check_object_name(name)
            except InvalidKeyError:
                log.warning("kvstore: refusing to store invalid object name %r", name)
                continue
            frames[i] = top.encode_now(tensor, name, layout, sealed=False)
            if frames[i] is None:
                later.append(i)
        if later:
            made = await asyncio.gather(
                *(top.encode_in_thread(items[i][1], items[i][0], layout, sealed=False) for i in later)
            )
            for i, parts in zip(later, made):
                frames[i] = parts
        return frames

    def _shortest_way(
        self, steps: list[tuple[int, Write] | Move]
    ) -> tuple[list[tuple[int, Write]], list[Move]]:
        """The plan's writes and moves.  A name this plan writes into tier j and *then*
        evicts from j again (a batch larger than the tier) goes straight where the plan
        leaves it: the demotion j → k becomes the write into k, and a drop from j means
        no write at all.  Only a move after the write is folded into it: a copy of the
        name evicted before the plan writes the name again is moved (or dropped) as
        planned, and the write that follows lands.  The engine's decisions stand; only
        the bytes take the short way (never through a full tier's medium)."""
        p = self.p
        writes: list[tuple[int, Write]] = []
        kept: list[Move] = []
        pending: dict[tuple[str, int], int] = {}  # (name, tier) -> index in `writes`
        dead: set[int] = set()
        for step in steps:
            if isinstance(step, tuple):
                pending[(step[1].key, step[1].dst)] = len(writes)
                writes.append(step)
                continue
            m = step
            if isinstance(m, (Copy, Drop)) and (m.key, m.src) in pending and not (
                isinstance(m, Copy) and m.kind == "promote"
            ):
                n = pending.pop((m.key, m.src))
                p.metrics.evictions.labels(p.labels[m.src]).inc()
                if isinstance(m, Drop) or (m.key, m.dst) in pending:  # dropped, or written there already
                    dead.add(n)
                else:
                    i, w = writes[n]
                    writes[n] = (i, Write(w.key, w.size, m.dst))
                    pending[(m.key, m.dst)] = n
                continue
            kept.append(m)
        return [w for n, w in enumerate(writes) if n not in dead], kept

    async def _write_tier(
        self,
        j: int,
        batch: list[tuple[int, Write]],
        items: Sequence[tuple[str, torch.Tensor]],
        frames: list[list[memoryview] | None],
        layout: str,
        results: list[bool],
        ticket: Ticket,
        reported: set[tuple[str, int]],
    ) -> None:
        p = self.p
        tier = p.tiers[j]
        same = tier.same_codec(p.tiers[0])
        payload: list[tuple[str, list[memoryview]]] = []
        encoded: list[bool] = []
        for i, w in batch:
            parts = frames[i]
            if not same:
                try:  # (a codec such as CacheGen: on a worker thread, the loop serves on)
                    parts = await tier.encode_off_loop(items[i][1], w.key, layout)
                except Exception as exc:  # this tier's codec cannot take it: a failed write there
                    log.warning("kvstore: %s cannot encode %s: %s", p.labels[j], w.key, exc)
                    encoded.append(False)
                    continue
            assert parts is not None  # names that could not be framed have no write
            encoded.append(True)
            payload.append((w.key, parts))
        if payload:
            # after the deletes of these names from tier j decided before this write (a drop
            # or delete of an earlier copy of the name): else one could land on these bytes
            await self.mover.settled(j, [name for name, _ in payload])
            await self.mover.room(j)  # demotions out of a full tier first: the backend need not evict
        t0 = time.perf_counter()
        written = iter(
            await p.guard.call(j, tier.put_frames(payload), [False] * len(payload), "put", write=True)
            if payload
            else []
        )
        p.metrics.op_seconds.labels("put", p.labels[j]).observe(time.perf_counter() - t0)
        ok = [next(written) if e else False for e in encoded]
        for (i, w), good in zip(batch, ok):
            name = w.key
            reported.add((name, j))
            if not good:  # off the books as it stops being written, in one stretch
                p.metrics.errors.labels("put", p.labels[j]).inc()
                with p.changing():
                    p.inflight.wrote(ticket, name)
                    p.placement.forget(name, j)
                continue
            p.inflight.wrote(ticket, name)
            if name not in p.placement.tiers[j].resident:
                # left this tier before it landed (deleted or expired meanwhile, or, in a
                # write-through tier, evicted once its other copy had landed): a demotion
                # (waiting for this write) has copied it on, or it was dropped
                if not p.inflight.copying(name):  # else the name's last copy cleans up
                    await self.mover.delete(j, [name])
                results[i] = p.placement.where(name) is not None
            else:
                results[i] = True
                p.metrics.bytes_in.labels(p.labels[j], namespace_of(name)).inc(w.size)
