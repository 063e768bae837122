"""Streamed reads: an object's bytes land where its reader says, block by block.

Owns: the `StreamSink` protocol a backend that supports ``read_streamed`` drives, and
`STREAM_BLOCK`.  Must not touch: frames or tensors (the sink knows those; the backend
only moves bytes).

A backend with ``async read_streamed(names, open_sink) -> [result | None]`` calls
``open_sink(name)`` once per name, in order, before any read starts; then, for each name,
in one blocking step off the event loop: open the object, read its first
``sink.head`` bytes, ask ``sink.body(head, size)`` where the rest goes (a buffer and the
object offset it starts at; None: stop here), read that range into the buffer in blocks
of `STREAM_BLOCK` bytes handing each block to ``sink.feed`` right after it lands (still
in cache), and return ``sink.finish()``.  A missing object or an I/O error is None.
Sinks run on the backend's worker threads, so what they call must be thread-safe.
"""

from __future__ import annotations

from typing import Any, Protocol

STREAM_BLOCK = 256 << 10


class StreamSink(Protocol):
    head: int

    def body(self, head: memoryview, size: int) -> tuple[memoryview, int] | None: ...

    def feed(self, block: memoryview) -> None: ...

    def finish(self) -> Any: ...


__all__ = ["STREAM_BLOCK", "StreamSink"]
