"""Streamed reads: an object's bytes land where its reader says, block by block.

Owns: the `StreamSink` protocol a backend that supports ``read_streamed`` drives, and
`stream_from_buffer`.  Must not touch: frames or tensors (the sink knows those; the backend
only moves bytes).

A backend with ``async read_streamed(names, open_sink) -> [result | None]`` calls
``open_sink(name)`` once per name, in order, before any read starts; then, for each name,
in one blocking step off the event loop: open the object, read its first
``sink.head`` bytes, ask ``sink.body(head, size)`` where the rest goes (a buffer and the
object offset it starts at; None: stop here), read that range into the buffer block by
block (socket reads, for Redis) handing each block to ``sink.feed`` right after it lands
(still in cache), and return ``sink.finish()``.  A missing object or an I/O error is None.
A backend that reads ranges of one object in parallel (S3) feeds the first range in
order and hashes each further range on its own thread with ``sink.hash``, then hands
the results over in order with ``sink.feed_hashed``.
A backend reading a local file hands the sink the open descriptor instead
(``sink.feed_pread``), so the read-and-hash loop can run without returning to Python.
An object already in memory goes through `stream_from_buffer`, which hands the sink
each source range with ``sink.feed_from(dst, src)``: the sink copies it (and may hash it
in the same pass over the bytes).
Sinks run on the backend's worker threads, so what they call must be thread-safe.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class StreamSink(Protocol):
    head: int

    def body(self, head: memoryview, size: int) -> tuple[memoryview, int] | None: ...

    def feed(self, block: memoryview) -> None: ...

    def feed_from(self, block: memoryview, src: memoryview) -> None:
        """Copy `src` into `block` (same length), then as `feed(block)`."""
        ...

    def hash(self, block: memoryview, value: int = 0) -> int:
        """The sink's hash of `block` continued from `value`; no state touched, so a
        backend may run it on several threads, one per range of the payload."""
        ...

    def feed_hashed(self, nbytes: int, value: int) -> None:
        """`nbytes` more payload bytes already in the sink's buffer, in order after what
        was fed before, whose `hash` from 0 is `value` (a range read in parallel)."""
        ...

    def feed_pread(self, fd: int, block: memoryview, offset: int, *, mapped: bool = False) -> int:
        """Read `block` from file descriptor `fd` at `offset` (a file a backend opened;
        short only at end of file), then as `feed` over what was read; bytes read.
        ``mapped``: the range lies within the file and the file is never changed in
        place, so it may be copied through a mapping of the file
        (`kvstore.checksum.mapped_crc32c`)."""
        ...

    def finish(self) -> Any: ...


async def wait_out(fut: asyncio.Future[Any]) -> None:
    """Wait until `fut` is done, whatever cancellations arrive meanwhile (a caller whose
    workers write into buffers it is about to free must not leave before they end)."""
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            continue


def stream_from_buffer(raw: memoryview, sink: StreamSink) -> object:
    """Drive `sink` over an object already in memory (a memory tier's view, or a buffer a
    network read filled): the same steps a streaming backend takes, the payload handed
    over in one `feed_from` (the sink copies and hashes it in one pass)."""
    raw = raw.cast("B") if raw.format != "B" or raw.ndim != 1 else raw
    size = len(raw)
    where = sink.body(raw[: min(size, sink.head)], size)
    if where is not None:
        dst, offset = where
        dst = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
        src = raw[offset : offset + len(dst)]
        sink.feed_from(dst[: len(src)], src)
    return sink.finish()


__all__ = ["StreamSink", "stream_from_buffer", "wait_out"]
