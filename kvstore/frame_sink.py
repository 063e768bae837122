"""A frame checked while it streams in: header first, then the payload block by block.

Owns: `FrameSink`, the `kvstore.backends.stream.StreamSink` that reads a stored frame's
prefix and header from its first bytes, asks its owner where the payload goes (e.g.
straight into the caller's tensor), hashes each payload block while it is still in
cache, and at the end says whether the frame was whole and intact.  Must not touch:
tensors and allocation (the owner's `place` callback), I/O (the backend's; it reads
only from a descriptor a backend opened and hands it, `feed_pread`).

The bytes land in the owner's buffer before they are verified: the owner must not hand
them on unless `finish()` left `error` unset.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.checksum import copy_crc32c, crc32c, crc32c_combine, mapped_crc32c, pread_crc32c
from kvstore.frame import (
    CHECKSUM_ALGO,
    MAX_HEADER_LEN,
    PREFIX,
    PREFIX_LEN,
    ChecksumMismatchError,
    FrameError,
    FrameHeader,
    LengthMismatchError,
    read_header,
)

HEAD = 4096  # header bytes read up front; a longer header falls back to a whole read

# the running form of `kvstore.frame.checksum`; a new frame checksum must be added here
assert CHECKSUM_ALGO == "crc32c", f"FrameSink cannot stream checksum {CHECKSUM_ALGO!r}"


class FrameSink:
    """One stored frame arriving from a backend; see the module docstring.

    After `finish()`: ``error`` (a `FrameError`: the object is defective), or
    ``too_long`` (header beyond `HEAD`: read it whole instead), or ``header`` with
    ``placed`` telling whether `place(header)` took the payload (False: it declined).
    """

    head = HEAD

    def __init__(self, name: str, place: Callable[[FrameHeader], memoryview | None]) -> None:
        self.name = name
        self.place = place
        self.header: FrameHeader | None = None
        self.error: FrameError | None = None
        self.too_long = False
        self.placed = False
        self._csum = 0
        self._got = 0

    def body(self, head: memoryview, size: int) -> tuple[memoryview, int] | None:
        if len(head) >= PREFIX_LEN:
            hlen = PREFIX.unpack_from(head, 0)[4]
            if len(head) < PREFIX_LEN + hlen <= min(size, PREFIX_LEN + MAX_HEADER_LEN):
                self.too_long = True
                return None
        try:
            header, off = read_header(head, key=self.name)  # a keyless or misplaced frame is refused
            if size - off != header.plen:
                raise LengthMismatchError(
                    f"payload is {size - off} bytes, header says {header.plen} (truncated or torn)"
                )
        except FrameError as exc:
            self.error = exc
            return None
        self.header = header
        dst = self.place(header)
        if dst is None:
            return None
        if dst.nbytes != header.plen:
            # a payload shorter than its place would leave the place's tail as it was (a
            # reused buffer's old bytes) under a checksum that passes; longer, past it
            self.error = LengthMismatchError(
                f"payload is {header.plen} bytes, its place {dst.nbytes} (shape {header.shape} "
                f"{header.dtype}): the frame disagrees with itself"
            )
            return None
        self.placed = True
        return dst, off

    def feed(self, block: memoryview) -> None:
        self._csum = crc32c(block, self._csum)
        self._got += len(block)

    def feed_from(self, block: memoryview, src: memoryview) -> None:
        self._csum = copy_crc32c(block, src, self._csum)  # one pass: copied and hashed
        self._got += len(block)

    def hash(self, block: memoryview, value: int = 0) -> int:
        """The payload hash of `block` continued from `value` (touches no state: safe on
        any thread, for a range read apart from the others)."""
        return crc32c(block, value)

    def feed_hashed(self, nbytes: int, value: int) -> None:
        """`nbytes` more payload bytes, already in place, whose `hash` from 0 is `value`."""
        self._csum = crc32c_combine(self._csum, value, nbytes)
        self._got += nbytes

    def feed_pread(self, fd: int, block: memoryview, offset: int, *, mapped: bool = False) -> int:
        done = mapped_crc32c(fd, block, offset, self._csum) if mapped else None
        if done is None:  # each block hashed as it lands
            done = pread_crc32c(fd, block, offset, self._csum)
        n, self._csum = done
        self._got += n
        return n

    def finish(self) -> FrameSink:
        if self.placed and self.header is not None:
            if self._got != self.header.plen:
                self.error = LengthMismatchError(f"read {self._got} of {self.header.plen} payload bytes")
            elif self._csum != self.header.csum:
                self.error = ChecksumMismatchError("payload fails its checksum")
        return self


__all__ = ["HEAD", "FrameSink"]
