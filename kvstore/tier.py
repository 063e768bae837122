"""One tier: a backend plus a codec, storing tensors as self-checking frames.

Owns: all tensor ↔ frame ↔ backend work for a single backend: encoding, reading into
caller buffers (streamed straight into them by `kvstore.tier_stream` where every name
has a target, else through pooled buffers), decoding, transcoding a frame into another codec
(`transcode`, also used by `kvstore.ops.migrate`), and the rule that a defective frame
is a miss: it is quarantined (`Tier.quarantine`), counted in the tier's own
`TierCounters` and logged, never raised and never handed back.  Must not touch:
placement across tiers (that is `kvstore.tiered` and the policy engine), deadlines and
breakers (`kvstore.tiered.guard`), URLs beyond opening the backend.

Reads decode with the codec named in each frame, so a tier can read objects another
tier (or a migration) wrote with a different codec.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvstore import checksum
from kvstore import codec as codecs
from kvstore.backends import Alloc, Backend, open_backend
from kvstore.backends.base import Capabilities, Defect, redact_url
from kvstore.backends.stream import wait_out
from kvstore.buffers import BufferPool
from kvstore.codec.base import CodecUnavailableError
from kvstore.frame import Frame, FrameError, decode_frame, encode_frame, seal_frames
from kvstore.keys import InvalidKeyError, check_object_name, printable_name
from kvstore.tier_stream import DECLINED, GONE, HIT, Out, ReadResult, read_streamed

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 1 << 20  # frames this large are checksummed / decoded in a worker thread

@dataclass(slots=True)
class TierCounters:
    """What one tier's reads and writes met (a hit is an object decoded or handed over)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    undecodable: int = 0
    declined: int = 0  # reads the caller skipped, or whose buffer did not fit the frame
    put_ok: int = 0
    put_failed: int = 0


def codec_for(name: str) -> codecs.Codec:
    """The codec a frame names; `CodecUnavailableError` when this process lacks it.

    A frame names its codec bare (``raw``, ``cachegen``: what it needs to decode is in
    its header and payload), so a name with options is refused unread: a stored frame
    must not choose the options a reader builds its codec with (a profile path to open,
    a thread count). Any failure to build it is the same counted miss."""
    if name not in codecs.names():
        raise CodecUnavailableError(f"frame names codec {name!r}, not one of {', '.join(codecs.names())}")
    try:
        return codecs.get(name)
    except Exception as exc:
        raise CodecUnavailableError(f"codec {name!r} is not available: {exc}") from exc


def transcode(
    frame: Frame, name: str, target: codecs.Codec, source: codecs.Codec | None = None
) -> list[memoryview]:
    """`frame` (object `name`) re-encoded as a frame of codec `target`; the new header
    keeps the layout and metadata and records the source's checksum and codec."""
    source = source if source is not None else codec_for(frame.header.codec)
    tensor = source.decode_payload(frame.payload, frame.header)
    enc = target.encode_parts(tensor, layout=frame.header.layout)
    meta = {
        **frame.header.meta,
        **enc.meta,
        "source_csum": frame.header.csum,
        "source_codec": frame.header.codec,
    }
    return encode_frame(
        enc.parts, codec=target.name, dtype=enc.dtype, shape=enc.shape, layout=enc.layout, key=name, meta=meta
    )


async def check_frame(raw: memoryview, name: str) -> Frame:
    """`decode_frame` of object `name` (raises `FrameError`), in a worker thread for large
    objects (CRC32C releases the GIL, so the check runs on another core)."""
    if raw.nbytes < OFFLOAD_BYTES:
        return decode_frame(raw, key=name)
    return await asyncio.to_thread(partial(decode_frame, raw, key=name))


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
        checksum.warm_up()  # the CRC32C kernels compile off the read path

    @classmethod
    def open(cls, url: str, codec: str | codecs.Codec = "raw", *, name: str = "") -> Tier:
        return cls(open_backend(url), codec, name=name)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    # -- writes --------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name: str, layout: str = "raw", *, sealed: bool = True) -> list[memoryview]:
        """`tensor` as this tier's frame of object `name` (the parts a backend writes);
        ``sealed=False``: an `UnsealedFrame`, for `put_frames` only (which seals it, or
        leaves that to a backend that hashes while it writes)."""
        return self.codec.frame_parts(tensor, key=name, layout=layout, sealed=sealed)

    async def encode_off_loop(
        self, tensor: torch.Tensor, name: str, layout: str = "raw", *, sealed: bool = True
    ) -> list[memoryview]:
        """`encode`, on a worker thread for a tensor of `OFFLOAD_BYTES` or more (the
        checksum and codecs release the GIL: the loop goes on, and several such calls
        run on several cores); a small one at once, on the loop, and always sealed; an
        unsealed one on the loop too where framing reads none of its bytes
        (`Codec.frames_in_place`: a hop would cost more than the framing)."""
        now = self.encode_now(tensor, name, layout, sealed=sealed)
        if now is not None:
            return now
        return await self.encode_in_thread(tensor, name, layout, sealed=sealed)

    async def encode_in_thread(
        self, tensor: torch.Tensor, name: str, layout: str = "raw", *, sealed: bool = True
    ) -> list[memoryview]:
        """`encode` on a worker thread (where `encode_now` said None)."""
        return await asyncio.to_thread(partial(self.encode, tensor, name, layout, sealed=sealed))

    def encode_now(
        self, tensor: torch.Tensor, name: str, layout: str = "raw", *, sealed: bool = True
    ) -> list[memoryview] | None:
        """`encode_off_loop`'s frame where it is made without a worker thread (a small
        tensor, or an unsealed frame that reads none of its bytes), else None."""
        if tensor.nbytes < OFFLOAD_BYTES:
            return self.encode(tensor, name, layout)
        if not sealed and self.codec.frames_in_place(tensor):
            return self.encode(tensor, name, layout, sealed=False)
        return None

    def same_codec(self, other: Tier) -> bool:
        """Whether frames `other` encodes are what this tier would encode."""
        return self.codec is other.codec or self.codec.name == other.codec.name

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
            return name, self.encode(tensor, name, layout)

        async def put_small() -> None:
            for i, r in zip(small, await self.put_frames([frame(i) for i in small])):
                ok[i] = r

        async def put_large(i: int) -> None:
            name, tensor = items[i]
            parts = await self.encode_off_loop(tensor, name, layout, sealed=False)
            (ok[i],) = await self.put_frames([(name, parts)])

        await asyncio.gather(*([put_small()] if small else []), *(put_large(i) for i in large))
        return ok

    async def put_frames(self, items: Sequence[tuple[str, Sequence[memoryview]]]) -> list[bool]:
        """Store framed objects (e.g. copied by a migration).  An `UnsealedFrame` is sealed
        first (its checksum computed, on worker threads, all at once) unless the backend
        computes it while writing (`Capabilities.seals_frames`)."""
        if not self.backend.capabilities.seals_frames:
            await seal_frames(parts for _, parts in items)
        ok = await self.backend.put_many(items)
        good = sum(ok)
        self.counters.put_ok += good
        self.counters.put_failed += len(ok) - good
        return ok

    # -- frames --------------------------------------------------------------------------
    async def get_frames(self, names: Sequence[str], alloc: Alloc | None = None) -> list[Frame | None]:
        """Verified frames (payload views into the read buffers); defects become None."""
        _, frames = await self._frames(names, alloc)
        self.counters.hits += sum(f is not None for f in frames)
        return frames

    async def _frames(
        self, names: Sequence[str], alloc: Alloc | None
    ) -> tuple[list[memoryview | None], list[Frame | None]]:
        """The objects read and their verified frames (None: a miss, or quarantined),
        without counting hits (the caller decodes, then counts)."""
        started = time.time()
        raws = await self.backend.get_many(names, alloc)
        return raws, list(await asyncio.gather(*(self._verify(n, raw, started) for n, raw in zip(names, raws))))

    async def _verify(self, name: str, raw: memoryview | None, started: float) -> Frame | None:
        if raw is None:
            self.counters.misses += 1
            return None
        try:
            return await check_frame(raw, name)
        except FrameError as exc:
            await self.quarantine(name, exc, Defect(read=raw, since=started))
            return None

    def decoder(self, codec: str) -> codecs.Codec:
        """The codec named `codec` (cached); `CodecUnavailableError` if this process lacks it."""
        dec = self._decoders.get(codec)
        if dec is None:
            dec = self._decoders[codec] = codec_for(codec)
        return dec

    def transcode(self, frame: Frame, name: str, target: codecs.Codec) -> list[memoryview]:
        """`frame` of object `name` (read from this tier) as a frame of codec `target`."""
        return transcode(frame, name, target, self.decoder(frame.header.codec))

    async def quarantine(self, name: str, exc: Exception, found: Defect | None = None) -> None:
        """Take defective object `name` out of service: counted (a corrupt miss), logged,
        and handed to the backend's quarantine; never raises.  With `found` (what the
        read found: its bytes, or the check they failed and when the read began), the
        backend takes the object only while it still is that, so a good copy another
        process stored in between stays in service."""
        self.counters.corrupt += 1
        self.counters.misses += 1
        log.warning(
            "kvstore: %s in %s is corrupt (%s); quarantined, served as a miss",
            printable_name(name),
            self.name,
            exc,
        )
        try:
            await self.backend.quarantine(name, f"{type(exc).__name__}: {exc}", found)
        except Exception:  # a failing quarantine must not turn a miss into a crash
            log.exception("kvstore: could not quarantine %s", printable_name(name))

    # -- tensor reads --------------------------------------------------------------------
    async def get_many(
        self,
        names: Sequence[str],
        out: Sequence[Out] | None = None,
        alloc: Alloc | None = None,
    ) -> list[torch.Tensor | None]:
        """Tensors for `names` (None = miss, or declined).  With `out`, each hit is
        written there (see `Out`).  Without `out` or `alloc`, raw tensors share the read
        buffer (no copy), except from a tier in memory (a copy: the read buffer is the
        stored object).  With a target for every name and no `alloc`, this is the read
        a store makes (`read_into`: streamed where the backend can)."""
        if alloc is None and out is not None and all(o is not None for o in out):
            return [r.tensor for r in await self.read_into(names, out, BufferPool(max_bytes=0))]
        raws, frames = await self._frames(names, alloc)
        return [r.tensor for r in await self._decode(names, frames, out, raws)]

    async def read_into(
        self, names: Sequence[str], outs: Sequence[Out] | None, pool: BufferPool
    ) -> list[ReadResult]:
        """A `ReadResult` per name; the payload is copied once.

        With a target for every name, a backend that declares streamed reads (disk,
        Redis) reads raw payloads straight into the targets, checksummed block by block
        as they land; other tiers that are not in memory read into buffers taken from
        `pool`, given back once decoded (nothing views them then)."""
        if outs is not None and all(o is not None for o in outs):
            res, rest = await read_streamed(self, names, outs, pool)
            if rest:
                again = await self._read_frames([names[k] for k in rest], [outs[k] for k in rest], pool)
                for k, r in zip(rest, again):
                    res[k] = r
            return res
        return await self._read_frames(names, outs, pool)

    async def _read_frames(
        self, names: Sequence[str], outs: Sequence[Out] | None, pool: BufferPool
    ) -> list[ReadResult]:
        """`read_into` through verified whole frames (pooled buffers where possible)."""
        taken: list[bytearray] = []
        pooled = not self.capabilities.in_memory and outs is not None and all(o is not None for o in outs)

        def alloc(size: int) -> memoryview:
            buf = pool.take(size)
            taken.append(buf)
            return memoryview(buf)

        try:
            reading = asyncio.ensure_future(self._frames(names, alloc if pooled else None))
            try:
                raws, frames = await asyncio.shield(reading)
            except asyncio.CancelledError:
                await asyncio.wait({reading})  # pooled buffers go back only once nothing writes them
                raise
            res = await self._decode(names, frames, outs, raws)
            del frames, raws  # payload views end here: decoded into the caller's tensors
        finally:
            for buf in taken:
                pool.give(buf)
        return res

    async def _decode(
        self,
        names: Sequence[str],
        frames: Sequence[Frame | None],
        outs: Sequence[Out] | None,
        raws: Sequence[memoryview | None],
    ) -> list[ReadResult]:
        """Decode verified frames (read as `raws`) into their targets, counting each
        outcome once."""
        c = self.counters
        res: list[ReadResult] = []
        for k, (name, frame) in enumerate(zip(names, frames)):
            if frame is None:
                res.append(ReadResult(None, GONE, 0))
                continue
            size = frame.header.plen
            target = outs[k] if outs is not None else None
            try:
                if callable(target):
                    target = target(frame.header)
                    if target is None:
                        c.hits += 1
                        c.declined += 1
                        res.append(ReadResult(None, DECLINED, size))
                        continue
                decoder = self.decoder(frame.header.codec)
                if frame.header.codec != "raw":  # (CacheGen: a worker thread, the loop serves on)
                    decoding = asyncio.ensure_future(
                        asyncio.to_thread(decoder.decode_payload, frame.payload, frame.header, target)
                    )
                    try:
                        tensor = await asyncio.shield(decoding)
                    except asyncio.CancelledError:  # it writes the caller's tensor, reads the read buffer:
                        await wait_out(decoding)  # both are free only once it is done
                        raise
                else:
                    tensor = decoder.decode_payload(frame.payload, frame.header, target)
                if target is None and self.capabilities.in_memory and frame.header.codec == "raw":
                    tensor = tensor.clone()  # else a view of the stored object, which the caller may write to
            except CodecUnavailableError as exc:  # fine where it is: another process can read it
                c.misses += 1
                c.undecodable += 1
                log.error(
                    "kvstore: %s in %s cannot be decoded here (%s); served as a miss",
                    printable_name(name),
                    self.name,
                    exc,
                )
                res.append(ReadResult(None, DECLINED, size))
            except FrameError as exc:
                await self.quarantine(name, exc, Defect(read=raws[k]))
                res.append(ReadResult(None, GONE, 0))
            except Exception as exc:
                if target is None and isinstance(exc, ValueError):  # no caller buffer: the frame is bad
                    await self.quarantine(name, exc, Defect(read=raws[k]))
                    res.append(ReadResult(None, GONE, 0))
                    continue
                # the caller's buffer did not fit: a miss, not a defect
                c.hits += 1
                c.declined += 1
                log.warning("kvstore: could not decode %s from %s: %s", printable_name(name), self.name, exc)
                res.append(ReadResult(None, DECLINED, size))
            else:
                c.hits += 1
                res.append(ReadResult(tensor, HIT, size))
        return res

    # -- the rest ------------------------------------------------------------------------
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
