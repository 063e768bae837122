"""A stand-in for `TieredStore`: tiers, hottest first, written through and read in order.

Owns: the multi-tier get/put/contains loop over `Tier` objects, promotion of a
lower-tier hit into the tiers above it, and per-tier hit counters.  Must not touch:
placement policy (the policy engine's job once `TieredStore` lands), backends.

It exposes the `TieredStore` calls the LMCache plugins use (`put_many(names,
tensors)`, `get_many(names, out)`, `contains_many`, `prefix_lookup`, `delete_many`,
`pin`/`unpin`, `drain`, `stats`, `close`), so the plugins switch over by changing
`StoreConfig.build`.  One extension: an `out` entry may be a callable taking the
frame header and returning the tensor to decode into (or None to skip), so a caller
can allocate exactly the stored shape before the single copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from kvstore import codec as codecs
from kvstore.frame import FrameError, FrameHeader
from kvstore.tier import Tier

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Out = Union["torch.Tensor", Callable[[FrameHeader], "torch.Tensor | None"], None]


class BufferPool:
    """Reused read buffers: a fresh 16 MiB ``bytearray`` costs page faults on every read
    (~1.7 GiB/s here), a reused one does not.  Buffers return after their frame is decoded."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._pooled = 0

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self._pooled -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        if self._pooled + len(buf) <= self.max_bytes:
            self._free.setdefault(len(buf), []).append(buf)
            self._pooled += len(buf)


@dataclass
class StackStats:
    tiers: list[str]
    codecs: list[str]
    hits: list[int]
    hit_bytes: list[int]
    misses: int = 0
    put_ok: int = 0
    put_failed: int = 0
    decode_errors: int = 0
    backends: list[dict[str, Any]] = field(default_factory=list)


class TierStack:
    def __init__(self, tiers: Sequence[Tier], *, promote: bool = True) -> None:
        if not tiers:
            raise ValueError("a TierStack needs at least one tier")
        self.tiers = list(tiers)
        self.promote = promote
        self._hits = [0] * len(self.tiers)
        self._hit_bytes = [0] * len(self.tiers)
        self._misses = 0
        self._put_ok = 0
        self._put_failed = 0
        self._decode_errors = 0
        self._decoders: dict[str, codecs.Codec] = {}
        self._background: set[asyncio.Task] = set()
        self._pool = BufferPool()

    @classmethod
    def open(cls, specs: Sequence[tuple[str, str]]) -> TierStack:
        return cls([Tier.open(url, codec, name=f"tier{i}") for i, (url, codec) in enumerate(specs)])

    # ------------------------------------------------------------------ writes
    async def put_many(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor], *, layout: str = "raw"
    ) -> list[bool]:
        """Write through every tier; True where at least the hottest tier holds it."""
        items = list(zip(names, tensors))
        results = await asyncio.gather(
            *(self._put_tier(t, items, layout) for t in self.tiers), return_exceptions=True
        )
        first = results[0]
        ok = list(first) if isinstance(first, list) else [False] * len(items)
        for r in results[1:]:
            if isinstance(r, list):
                ok = [a or b for a, b in zip(ok, r)]
        good = sum(ok)
        self._put_ok += good
        self._put_failed += len(ok) - good
        return ok

    async def _put_tier(self, tier: Tier, items, layout: str) -> list[bool]:
        try:
            return await tier.put_many(items, layout=layout)
        except Exception as exc:  # an encoder or backend bug must not reach the caller
            log.warning("kvstore: put into %s failed: %s", tier.name, exc)
            return [False] * len(items)

    # ------------------------------------------------------------------- reads
    async def get_many(
        self, names: Sequence[str], out: Sequence[Out] | None = None
    ) -> list[torch.Tensor | None]:
        tensors, _ = await self.get_many_with_source(names, out)
        return tensors

    async def get_many_with_source(
        self, names: Sequence[str], out: Sequence[Out] | None = None
    ) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """Tensors (None = miss) and the index of the tier that served each."""
        n = len(names)
        result: list[torch.Tensor | None] = [None] * n
        source: list[int | None] = [None] * n
        todo = list(range(n))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            # in-memory tiers hand out zero-copy views; the others read into pooled buffers
            pooled = (
                not tier.backend.url.startswith("mem:")
                and out is not None
                and all(o is not None for o in out)
            )
            taken: list[bytearray] = []

            def alloc(size: int, taken: list[bytearray] = taken) -> memoryview:
                buf = self._pool.take(size)
                taken.append(buf)
                return memoryview(buf)

            try:
                frames = await tier.get_frames([names[i] for i in todo], alloc if pooled else None)
            except Exception as exc:
                log.warning("kvstore: read from %s failed: %s", tier.name, exc)
                for buf in taken:
                    self._pool.give(buf)
                continue
            still = []
            for i, frame in zip(todo, frames):
                if frame is None:
                    still.append(i)
                    continue
                tensor = await self._decode(tier, names[i], frame, out[i] if out is not None else None)
                if tensor is None:
                    still.append(i)
                    continue
                result[i], source[i] = tensor, ti
                self._hits[ti] += 1
                self._hit_bytes[ti] += frame.payload.nbytes
            del frames  # the payload views end here: decoded into `out` already
            for buf in taken:
                self._pool.give(buf)
            if ti > 0 and self.promote:
                up = [(names[i], result[i]) for i in todo if source[i] == ti]
                if up:
                    self._spawn(self._promote(ti, up))
            todo = still
        self._misses += len(todo)
        return result, source

    async def _decode(self, tier: Tier, name: str, frame, target: Out) -> torch.Tensor | None:
        try:
            if callable(target):
                target = target(frame.header)
                if target is None:
                    return None
            dec = self._decoders.get(frame.header.codec)
            if dec is None:
                dec = self._decoders[frame.header.codec] = codecs.get(frame.header.codec)
            return dec.decode_payload(frame.payload, frame.header, target)
        except FrameError as exc:
            await tier._quarantine(name, exc)
        except Exception as exc:  # the caller's buffer did not fit: a miss, not a defect
            self._decode_errors += 1
            log.warning("kvstore: could not decode %s from %s: %s", name, tier.name, exc)
        return None

    async def _promote(self, from_tier: int, items: list[tuple[str, torch.Tensor]]) -> None:
        for tier in self.tiers[:from_tier]:
            await self._put_tier(tier, items, "raw")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------------------- lookups
    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        found = [False] * len(names)
        todo = list(range(len(names)))
        for tier in self.tiers:
            if not todo:
                break
            try:
                hits = await tier.contains_many([names[i] for i in todo])
            except Exception as exc:
                log.warning("kvstore: contains on %s failed: %s", tier.name, exc)
                continue
            for i, hit in zip(todo, hits):
                found[i] = found[i] or hit
            todo = [i for i in todo if not found[i]]
        return found

    async def prefix_lookup(self, names: Sequence[str]) -> int:
        """How many leading names are stored (in any tier)."""
        found = await self.contains_many(names)
        return found.index(False) if False in found else len(found)

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        existed = [False] * len(names)
        for tier in self.tiers:
            try:
                res = await tier.delete_many(names)
            except Exception as exc:
                log.warning("kvstore: delete on %s failed: %s", tier.name, exc)
                continue
            existed = [a or b for a, b in zip(existed, res)]
        return existed

    def pin(self, names: Sequence[str]) -> None:
        """Placement pins belong to the policy engine; nothing is evicted mid-read here."""

    def unpin(self, names: Sequence[str]) -> None:
        """See `pin`."""

    async def drain(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def stats(self) -> StackStats:
        return StackStats(
            tiers=[t.name for t in self.tiers],
            codecs=[t.codec.name for t in self.tiers],
            hits=list(self._hits),
            hit_bytes=list(self._hit_bytes),
            misses=self._misses,
            put_ok=self._put_ok,
            put_failed=self._put_failed,
            decode_errors=self._decode_errors,
            backends=[t.backend.stats().to_dict() for t in self.tiers],
        )

    async def close(self) -> None:
        await self.drain()
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception as exc:
                log.warning("kvstore: closing %s failed: %s", tier.name, exc)
