"""Reused read buffers for the hot read path.

Owns: `BufferPool`, a bounded free list of ``bytearray`` buffers keyed by size.  A fresh
16-32 MiB ``bytearray`` costs page faults on every read (~1.7 GiB/s here); a reused one
does not (~18 GiB/s to copy into).  Must not touch: what is read into the buffers, or
when: callers take a buffer, read and decode out of it, then give it back.

A buffer may be given back only once nothing views it any more (its frame has been
decoded into the caller's tensor).
"""

from __future__ import annotations


class BufferPool:
    """Buffers by exact size, at most `max_bytes` of them kept free."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._pooled = 0

    def take(self, size: int) -> bytearray:
        """A buffer of exactly `size` bytes (contents undefined)."""
        free = self._free.get(size)
        if free:
            self._pooled -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Return a buffer nothing views any more; dropped when the pool is full."""
        if self._pooled + len(buf) <= self.max_bytes:
            self._free.setdefault(len(buf), []).append(buf)
            self._pooled += len(buf)

    @property
    def pooled_bytes(self) -> int:
        return self._pooled


__all__ = ["BufferPool"]
