"""A tier's streamed read: raw payloads straight into the callers' tensors.

Owns: the outcome of reading one name (`ReadResult`: `HIT`, `GONE`, `DECLINED`), where
a read may go (`Out`), and `read_streamed`, the read `kvstore.tier.Tier.read_into`
makes when every name has a target: a backend that declares ``streamed_reads`` streams
each object through a `kvstore.frame_sink.FrameSink` into its target, checksummed block
by block as it lands; another backend reads whole objects (memory views, or pooled
buffers) that are then streamed into the targets the same way.  Must not touch: codecs
other than raw (those frames are handed back to be read whole), placement, deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, Union

from kvstore.backends.base import Defect
from kvstore.backends.stream import wait_out
from kvstore.buffers import BufferPool
from kvstore.frame import FrameError, FrameHeader, decode_frame
from kvstore.keys import printable_name
from kvstore.shared_jobs import run_shared

if TYPE_CHECKING:
    import torch

    from kvstore.frame_sink import FrameSink
    from kvstore.tier import Tier

log = logging.getLogger(__name__)

PARALLEL_MIN = 8 << 20  # a batch of buffers smaller than this is copied on the event loop
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

#: where a read goes: a tensor to decode into, or a callable given the checked header
#: that returns one (None: skip this object, it stays stored), or None (a new tensor)
Out = Union["torch.Tensor", Callable[[FrameHeader], "torch.Tensor | None"], None]


@dataclass(frozen=True, slots=True)
class ByteTarget:
    """A caller's memory for one raw payload, described instead of wrapped in a tensor:
    the shape and dtype name (as frames record them, e.g. ``"bfloat16"``) its bytes
    hold, and a writable view of those bytes.  A streamed read checks the frame's
    shape and dtype against it as against a tensor's.  For callers that hold only an
    address (LMCache's MemoryObjs): a tensor view of one costs a few torch calls (~6 µs
    in a quiet loop, several times that right after a batch's copies have flushed the
    caches) on the path of every chunk of a load.  Taken by
    `kvstore.tiered.TieredStore.read_now` only (a `get_many` hit returns a tensor)."""

    shape: tuple[int, ...]
    dtype: str
    data: memoryview


#: where a read off the loop may go (`StreamTargets`): an `Out`, a `ByteTarget`, or a
#: callable given the checked header that returns either (None: skip this object)
Target = Union[Out, ByteTarget, Callable[[FrameHeader], "torch.Tensor | ByteTarget | None"]]

# outcome of reading one name (`ReadResult.status`)
HIT, GONE, DECLINED = 0, 1, 2  # DECLINED: stored, but the caller did not take it


def refused_as(name: str) -> Callable[[memoryview], bool]:
    """The checks a streamed read makes of object `name`, on the object read back whole:
    True while it fails one (`kvstore.backends.base.Defect.fails`, where the bytes found
    defective were streamed away): the frame (`decode_frame`: key, length, checksum),
    and for a raw payload its length against its header's shape and dtype."""

    def refused(raw: memoryview) -> bool:
        from kvstore.codec.base import dtype_from_name

        try:
            frame = decode_frame(raw, key=name)
            h = frame.header
            if h.codec == "raw":
                numel = 1
                for d in h.shape:
                    numel *= d
                if numel * dtype_from_name(h.dtype).itemsize != h.plen:
                    return True
        except (FrameError, ValueError, TypeError, KeyError):
            return True
        return False

    return refused


class ReadResult(NamedTuple):
    tensor: torch.Tensor | None
    status: int  # HIT | GONE | DECLINED (`kvstore.tiered` adds UNAVAILABLE)
    size: int  # payload bytes of the stored frame (0 when GONE)


class StreamTargets:
    """Where one streamed read into `outs` puts each payload (`sinks`: a `FrameSink`
    per name, whose payload goes straight into its target when the header matches it),
    and what each found: ``targets[k]`` the tensor its payload went into, ``whole[k]``
    not raw (to be read whole and decoded), ``refused[k]`` why its target did not take
    it.  Setting ``stopped`` (a cancelled read) makes every later header decline its
    place.  The sinks refer to this object, not it to them: no reference cycle, so a
    read's sinks go when their last user drops them (a cycle per read left them to the
    collector, whose full passes over a process holding LMCache and torch took
    milliseconds)."""

    def __init__(self, outs: Sequence[Target]) -> None:
        n = len(outs)
        self.outs = outs
        self.targets: list[torch.Tensor | ByteTarget | None] = [None] * n
        self.whole = [False] * n
        self.refused: list[Exception | None] = [None] * n
        self.stopped = False

    def sinks(self, names: Sequence[str]) -> list[FrameSink]:
        """A sink per name (the k-th places into ``outs[k]``)."""
        from kvstore.frame_sink import FrameSink

        return [FrameSink(name, partial(self._place, k)) for k, name in enumerate(names)]

    def _place(self, k: int, header: FrameHeader) -> memoryview | None:
        import torch

        from kvstore.codec.base import DTYPE_NAMES, dtype_from_name

        if self.stopped:
            return None
        if header.codec != "raw":
            self.whole[k] = True  # decoded by its codec: read whole
            return None
        try:
            t = self.outs[k]
            if callable(t):
                t = t(header)
            if t is None:
                return None
            if isinstance(t, ByteTarget):
                if t.shape != tuple(header.shape) or t.dtype != header.dtype or t.dtype not in DTYPE_NAMES:
                    raise ValueError(f"out is {t.shape} {t.dtype}; frame holds {header.shape} {header.dtype}")
                self.targets[k] = t
                return t.data
            if (
                tuple(t.shape) != tuple(header.shape)
                or t.dtype != dtype_from_name(header.dtype)
                or t.device.type != "cpu"
                or not t.is_contiguous()
            ):
                raise ValueError(
                    f"out is {tuple(t.shape)} {t.dtype} on {t.device}; frame holds {header.shape} {header.dtype}"
                )
        except Exception as exc:
            self.refused[k] = exc
            return None
        self.targets[k] = t
        if t.numel() == 0:
            return memoryview(bytearray(0))
        return t.reshape(-1).view(torch.uint8).numpy().data

    def clean(self, k: int, sink: FrameSink, verdict: object | None) -> int | None:
        """The payload bytes of read `k` (through `sink`) when it landed whole and
        verified in its target (`verdict`: what the backend's read returned, None for
        none); None otherwise (a miss, a defect, a frame to read whole, a declined
        place: the regular read path knows what each means)."""
        if verdict is None or sink.too_long or self.whole[k] or sink.error is not None or not sink.placed:
            return None
        header = sink.header
        return None if header is None or self.targets[k] is None else header.plen


async def read_streamed(
    tier: Tier, names: Sequence[str], outs: Sequence[Out], pool: BufferPool
) -> tuple[list[ReadResult], list[int]]:
    """Raw payloads straight into the callers' tensors, hashed block by block as they
    land; also the indices to read whole instead (not raw, or a header too long to
    stream).  A streaming backend (disk) runs `place` on its worker threads."""
    reads = StreamTargets(outs)
    sinks = reads.sinks(names)
    targets, whole, refused = reads.targets, reads.whole, reads.refused
    verdicts: list[object | None]
    started = time.time()  # a defective object is quarantined only if unchanged since (disk)
    if tier.capabilities.streamed_reads:
        order = iter(sinks)  # one sink per name, taken in order (a name may repeat)
        reading = asyncio.ensure_future(tier.backend.read_streamed(names, lambda _name: next(order)))
        try:
            verdicts = await asyncio.shield(reading)
        except asyncio.CancelledError:
            # the read may be writing into the callers' tensors: the caller may free them
            # only once those writes are over (at once for a backend that streams on the
            # event loop; a disk read's worker threads finish their block first)
            reads.stopped = True
            if tier.capabilities.streams_on_loop or tier.capabilities.cancels_cleanly:
                reading.cancel()
            await wait_out(reading)
            raise
    else:  # whole objects (memory views, or pooled buffers), then copied into the targets
        taken: list[bytearray] = []

        def alloc(size: int) -> memoryview:
            buf = pool.take(size)
            taken.append(buf)
            return memoryview(buf)

        try:
            raws = await tier.backend.get_many(names, None if tier.capabilities.in_memory else alloc)
            try:
                verdicts = await _stream_buffers(raws, sinks)
            except asyncio.CancelledError:
                reads.stopped = True  # no more places; the copies under way have ended
                raise
            del raws
        finally:
            for buf in taken:
                pool.give(buf)
    c = tier.counters
    res: list[ReadResult] = []
    rest: list[int] = []
    for k, (name, sink) in enumerate(zip(names, sinks)):
        header = sink.header
        if verdicts[k] is None:
            c.misses += 1
            res.append(ReadResult(None, GONE, 0))
        elif sink.too_long or whole[k]:
            rest.append(k)
            res.append(ReadResult(None, GONE, 0))
        elif sink.error is not None:
            await tier.quarantine(name, sink.error, Defect(since=started, fails=refused_as(name)))
            res.append(ReadResult(None, GONE, 0))
        elif header is None:  # no error, yet no header: cannot happen; a miss
            c.misses += 1
            res.append(ReadResult(None, GONE, 0))
        elif not sink.placed:
            c.hits += 1
            c.declined += 1
            if refused[k] is not None:
                log.warning(
                    "kvstore: could not decode %s from %s: %s", printable_name(name), tier.name, refused[k]
                )
            res.append(ReadResult(None, DECLINED, header.plen))
        else:
            c.hits += 1
            t = targets[k]
            assert not isinstance(t, ByteTarget), "get_many's outs are tensors (ByteTargets: read_now)"
            res.append(ReadResult(t, HIT, header.plen))
    return res, rest


async def _stream_buffers(raws: Sequence[memoryview | None], sinks: Sequence[FrameSink]) -> list[object | None]:
    """Each buffer read whole into its sink (copied and hashed in one pass): on the event
    loop for a small batch, else on at most one worker job per CPU, each taking the next
    buffer until none is left (`kvstore.shared_jobs`), as the disk tier's reads are (a
    16 MiB copy-and-hash is memory-bound: one core copies at ~5 GB/s here, so a batch
    from the memory tier took a core's time per byte on the loop).  Every job has ended
    before this returns or raises, cancelled or not: they write into the callers'
    tensors; cancelled, the buffers not yet begun are skipped.  A fault in a sink is
    raised once every copy is over."""
    from kvstore.backends.stream import stream_from_buffer

    verdicts: list[object | None] = [None] * len(raws)
    todo = [(k, r) for k, r in enumerate(raws) if r is not None]
    jobs = min(len(todo), _CPUS)
    if jobs < 2 or sum(r.nbytes for _, r in todo) < PARALLEL_MIN:
        for k, r in todo:
            verdicts[k] = stream_from_buffer(r, sinks[k])
        return verdicts
    results = await run_shared(lambda kr: stream_from_buffer(kr[1], sinks[kr[0]]), todo, jobs)
    fault: BaseException | None = None
    for (k, _), v in zip(todo, results):
        if isinstance(v, BaseException):
            fault = fault or v
        else:
            verdicts[k] = v
    if fault is not None:
        raise fault
    return verdicts
