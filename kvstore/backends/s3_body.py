"""Request and response bodies for the S3 backend without whole-payload copies.

Owns: `PartsBody`, a file-like view over a list of byte buffers that botocore accepts as
a request body (it sizes, hashes and rewinds it through ``len/read/seek/tell``), the
aiohttp payload that sends those buffers to the socket as they are (in copied pieces on
Python 3.12 and later: `QUEUES_VIEWS`), and `read_into`,
which streams a response body straight into a caller's buffer.  Must not touch: S3
semantics, retries, counters.

Why: botocore takes only bytes, bytearray or file-like bodies; a frame is a list of
parts (header + payload) and a multipart part is a slice of a larger buffer, so passing
bytes would mean joining or slicing into fresh copies (a fresh 32 MiB bytes costs
~20 ms here).  aiohttp would send a generic file-like body through a thread pool in
64 KiB reads; the payload registered here writes the memoryviews directly instead.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence

import aiohttp.payload

#: Python 3.12 and later: a transport queues the unsent part of a memoryview without
#: copying it, and a request cancelled (its deadline) closes its transport gracefully,
#: which goes on sending the queue.  Sent from the caller's buffers, a body would then
#: end with whatever the caller wrote there after it got the failure back, and the
#: server could store that in place of a good object.  There, bodies go in copied
#: pieces (`PIECE`): what is queued is the body as it was.
QUEUES_VIEWS = sys.version_info >= (3, 12)
PIECE = 1 << 20


class PartsBody:
    """A read-only, seekable file-like object over `parts` (memoryviews, no copies)."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = [p for p in parts if p.nbytes]
        self.size = sum(p.nbytes for p in self.parts)
        self._pos = 0

    def __len__(self) -> int:
        return self.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, min(self.size, base + offset))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Copy out up to `n` bytes (botocore hashes bodies through this in small reads)."""
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = bytearray()
        pos = self._pos
        for view, lo in self._spans(pos, end):
            take = min(view.nbytes - lo, end - pos)
            out += view[lo : lo + take]
            pos += take
        self._pos = end
        return bytes(out)

    def _spans(self, start: int, end: int):
        offset = 0
        for view in self.parts:
            if offset + view.nbytes > start and offset < end:
                yield view, max(0, start - offset)
            offset += view.nbytes

    def views(self) -> list[memoryview]:
        """The whole body as the caller's buffers (what goes on the wire)."""
        return self.parts

    def close(self) -> None:
        pass


class _PartsPayload(aiohttp.payload.Payload):
    """aiohttp payload for `PartsBody`: each buffer goes to the transport as it is."""

    _autoclose = True

    def __init__(self, value: PartsBody, *args, **kwargs) -> None:
        kwargs.setdefault("content_type", "application/octet-stream")
        super().__init__(value, *args, **kwargs)
        self._size = value.size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("binary S3 body")

    async def write(self, writer) -> None:
        for view in self._value.views():
            await _send(writer, view)

    async def write_with_length(self, writer, content_length: int | None) -> None:
        left = self._value.size if content_length is None else content_length
        for view in self._value.views():
            if left <= 0:
                break
            chunk = view if view.nbytes <= left else view[:left]
            await _send(writer, chunk)
            left -= chunk.nbytes


async def _send(writer, view: memoryview) -> None:
    """`view` to the transport: as it is, or in copied pieces where a transport would
    queue the view itself (`QUEUES_VIEWS`)."""
    if not QUEUES_VIEWS:
        await writer.write(view)
        return
    for lo in range(0, view.nbytes, PIECE):
        await writer.write(bytes(view[lo : lo + PIECE]))


aiohttp.payload.PAYLOAD_REGISTRY.register(_PartsPayload, PartsBody)


def slice_parts(parts: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The bytes [start, end) of the concatenation of `parts`, as views (no copies)."""
    out = []
    offset = 0
    for view in parts:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            out.append(view[lo - offset : hi - offset])
        offset += view.nbytes
        if offset >= end:
            break
    return out


class ShortBody(Exception):
    """The server sent fewer or more bytes than it announced."""


async def read_into(body, view: memoryview) -> None:
    """Stream an aiobotocore response `body` into `view`, which must be its exact size.

    Each chunk aiohttp received is copied once, into `view`.  The connection goes back
    to the pool when the body is complete and is closed on any error.
    """
    content = body.content  # the aiohttp StreamReader behind aiobotocore's StreamingBody
    pos, n = 0, view.nbytes
    try:
        while pos < n:
            chunk = await content.readany()
            if not chunk:
                raise ShortBody(f"body ended after {pos} of {n} bytes")
            m = len(chunk)
            if pos + m > n:
                raise ShortBody(f"body longer than the announced {n} bytes")
            view[pos : pos + m] = chunk
            pos += m
    except BaseException:
        body.close()
        raise
    body.release()
