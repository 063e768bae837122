"""One tier: a backend plus a codec, storing tensors as self-checking frames.

Owns: tensor ↔ frame ↔ backend for a single backend, and the rule that a defective
frame is a miss: it is quarantined, counted and logged, never raised and never handed
back.  Must not touch: placement across tiers (that is `TieredStore` and the policy
engine), URLs beyond opening the backend.

Reads decode with the codec named in each frame, so a tier can read objects another
tier (or a migration) wrote with a different codec.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvstore import codec as codecs
from kvstore.backends import Alloc, Backend, open_backend
from kvstore.backends.base import redact_url
from kvstore.codec.base import CodecUnavailableError
from kvstore.frame import Frame, FrameError, decode_frame
from kvstore.keys import InvalidKeyError, check_object_name, printable_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 1 << 20  # frames this large are checksummed / decoded in a worker thread


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    undecodable: int = 0
    put_ok: int = 0
    put_failed: int = 0


def _storable(name: str) -> bool:
    """Whether `name` is a valid object name (else that item alone fails, logged)."""
    try:
        check_object_name(name)
    except InvalidKeyError as exc:
        log.warning("kvstore: refusing object name: %s", exc)
        return False
    return True


class Tier:
    """Tensors in, tensors out, through one backend; see the module docstring."""

    def __init__(self, backend: Backend, codec: str | codecs.Codec = "raw", *, name: str = "") -> None:
        self.backend = backend
        self.codec = codecs.get(codec) if isinstance(codec, str) else codec
        self.name = name or redact_url(backend.url)
        self.counters = TierCounters()
        self._decoders: dict[str, codecs.Codec] = {self.codec.name: self.codec}

    @classmethod
    def open(cls, url: str, codec: str | codecs.Codec = "raw", *, name: str = "") -> Tier:
        return cls(open_backend(url), codec, name=name)

    async def put_many(self, items: Sequence[tuple[str, torch.Tensor]], *, layout: str = "raw") -> list[bool]:
        """Encode and store; False where the backend could not store (counted there).

        Small items go to the backend as one batch.  Large ones (≥ `OFFLOAD_BYTES`) are
        encoded in a worker thread (checksums and codecs release the GIL, so this runs on
        another core) and written one by one, concurrently.
        """
        ok = [False] * len(items)
        valid = [i for i, (name, _) in enumerate(items) if _storable(name)]  # others: that item's False
        self.counters.put_failed += len(items) - len(valid)
        small = [i for i in valid if items[i][1].nbytes < OFFLOAD_BYTES]
        large = [i for i in valid if items[i][1].nbytes >= OFFLOAD_BYTES]

        def frame(i: int) -> tuple[str, list[memoryview]]:
            name, tensor = items[i]
            return name, self.codec.frame_parts(tensor, key=name, layout=layout)

        async def put_small() -> None:
            for i, r in zip(small, await self.put_frames([frame(i) for i in small])):
                ok[i] = r

        async def put_large(i: int) -> None:
            (ok[i],) = await self.put_frames([await asyncio.to_thread(frame, i)])

        await asyncio.gather(*([put_small()] if small else []), *(put_large(i) for i in large))
        return ok

    async def put_frames(self, items: Sequence[tuple[str, Sequence[memoryview]]]) -> list[bool]:
        """Store already-framed objects (e.g. copied by a migration)."""
        ok = await self.backend.put_many(items)
        good = sum(ok)
        self.counters.put_ok += good
        self.counters.put_failed += len(ok) - good
        return ok

    async def get_frames(self, names: Sequence[str], alloc: Alloc | None = None) -> list[Frame | None]:
        """Verified frames (payload views into the read buffers); defects become None."""
        raws = await self.backend.get_many(names, alloc)
        return list(await asyncio.gather(*(self._verify(n, raw) for n, raw in zip(names, raws))))

    async def _verify(self, name: str, raw: memoryview | None) -> Frame | None:
        if raw is None:
            self.counters.misses += 1
            return None
        try:
            frame = (
                decode_frame(raw, key=name)
                if raw.nbytes < OFFLOAD_BYTES
                else await asyncio.to_thread(partial(decode_frame, raw, key=name))
            )
        except FrameError as exc:
            await self._quarantine(name, exc)
            return None
        self.counters.hits += 1
        return frame

    async def get_many(
        self,
        names: Sequence[str],
        out: Sequence[torch.Tensor | None] | None = None,
        alloc: Alloc | None = None,
    ) -> list[torch.Tensor | None]:
        """Tensors for `names` (None = miss).  With `out`, each hit is written there.

        Without `out` or `alloc`, raw tensors share the read buffer (no copy).
        """
        frames = await self.get_frames(names, alloc)
        result: list[torch.Tensor | None] = []
        for i, (name, frame) in enumerate(zip(names, frames)):
            if frame is None:
                result.append(None)
                continue
            try:
                dec = self._decoder(frame.header.codec)
                target = out[i] if out is not None else None
                result.append(dec.decode_payload(frame.payload, frame.header, target))
            except CodecUnavailableError as exc:
                self.counters.hits -= 1
                self.counters.misses += 1
                self.counters.undecodable += 1
                log.error(
                    "kvstore: %s in %s cannot be decoded here (%s); served as a miss",
                    printable_name(name),
                    self.name,
                    exc,
                )
                result.append(None)
            except (FrameError, ValueError) as exc:
                self.counters.hits -= 1
                await self._quarantine(name, exc)
                result.append(None)
        return result

    def _decoder(self, name: str) -> codecs.Codec:
        dec = self._decoders.get(name)
        if dec is None:
            try:
                dec = self._decoders[name] = codecs.get(name)
            except (ValueError, ImportError) as exc:
                raise CodecUnavailableError(f"codec {name!r} is not available: {exc}") from exc
        return dec

    async def _quarantine(self, name: str, exc: Exception) -> None:
        self.counters.corrupt += 1
        self.counters.misses += 1
        log.warning(
            "kvstore: %s in %s is corrupt (%s); quarantined, served as a miss",
            printable_name(name),
            self.name,
            exc,
        )
        try:
            await self.backend.quarantine(name, f"{type(exc).__name__}: {exc}")
        except Exception:  # a failing quarantine must not turn a miss into a crash
            log.exception("kvstore: could not quarantine %s", printable_name(name))

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        return await self.backend.contains_many(names)

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        return await self.backend.delete_many(names)

    async def close(self) -> None:
        await self.backend.close()

    async def __aenter__(self) -> Tier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
