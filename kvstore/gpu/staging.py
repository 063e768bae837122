"""Reusable staging memory: pinned host buffers and a growable device scratch.

Owns: a size-classed pool of (pinned, when CUDA exists) host buffers that are handed
out, tagged with the event of the device copy still using them, and reused once that
event has completed, so no request pins memory of its own; and a per-direction device
scratch tensor that grows to the largest chunk seen and is reused after that.

Must not touch: KV layouts, LMCache objects, copy ordering (see kvstore.gpu.transfer).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch

__all__ = ["DeviceScratch", "PinnedPool", "PoolStats", "StagingBuffer"]

_MiB = 1 << 20


def _size_class(nbytes: int, minimum: int) -> int:
    size = max(int(nbytes), minimum, 1)
    return 1 << (size - 1).bit_length()


@dataclass
class StagingBuffer:
    """One pooled host buffer; ``event`` marks a device copy that still uses it."""

    data: torch.Tensor  # uint8, 1-D
    event: torch.cuda.Event | None = None  # set on CUDA only

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def view(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first ``prod(shape)`` elements, typed and shaped (no copy)."""
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.capacity:
            raise ValueError(f"staging buffer of {self.capacity} bytes cannot hold {nbytes}")
        return self.data[:nbytes].view(dtype).view(shape)

    def busy(self) -> bool:
        return self.event is not None and not self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


@dataclass
class PoolStats:
    allocations: int = 0  # buffers created (pinned once, then reused)
    reuses: int = 0
    waits: int = 0  # acquisitions that had to wait for an in-flight copy
    dropped: int = 0  # buffers freed to stay under max_cached_bytes
    cached_bytes: int = 0


@dataclass
class PinnedPool:
    """Host staging buffers in power-of-two size classes, reused across requests.

    ``pin=None`` pins when CUDA is available (pinned memory needs an accelerator); on a
    CPU-only machine the pool hands out ordinary buffers with identical bookkeeping.
    Buffers in flight are never handed out twice: :meth:`acquire` prefers an idle
    buffer, waits for the oldest in-flight one only when the pool is at its cap.
    """

    max_cached_bytes: int = 2 << 30
    pin: bool | None = None
    min_buffer_bytes: int = _MiB
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self) -> None:
        if self.pin is None:
            self.pin = torch.cuda.is_available()
        self._free: dict[int, deque[StagingBuffer]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> StagingBuffer:
        size = _size_class(nbytes, self.min_buffer_bytes)
        with self._lock:
            free = self._free.setdefault(size, deque())
            for _ in range(len(free)):
                buf = free.popleft()
                if not buf.busy():
                    buf.event = None
                    self.stats.reuses += 1
                    return buf
                free.append(buf)
            reused: StagingBuffer | None = None
            if free and self.stats.cached_bytes + size > self.max_cached_bytes:
                reused = free.popleft()
                self.stats.waits += 1
                self.stats.reuses += 1
            else:
                self.stats.allocations += 1
                self.stats.cached_bytes += size
        if reused is not None:
            reused.wait()
            return reused
        return StagingBuffer(torch.empty(size, dtype=torch.uint8, pin_memory=bool(self.pin)))

    def release(self, buf: StagingBuffer, event: torch.cuda.Event | None = None) -> None:
        """Return ``buf``; it is reused once ``event`` (its last device copy) completes."""
        buf.event = event
        with self._lock:
            self._free.setdefault(buf.capacity, deque()).append(buf)
            while self.stats.cached_bytes > self.max_cached_bytes and self._drop_one_idle():
                pass

    def _drop_one_idle(self) -> bool:
        for free in self._free.values():
            for buf in list(free):
                if not buf.busy():
                    free.remove(buf)
                    self.stats.cached_bytes -= buf.capacity
                    self.stats.dropped += 1
                    return True
        return False

    def clear(self) -> None:
        """Wait for in-flight copies and drop every cached buffer."""
        with self._lock:
            buffers = [b for free in self._free.values() for b in free]
            self._free.clear()
            self.stats.cached_bytes = 0
        for buf in buffers:
            buf.wait()


class DeviceScratch:
    """One growable device buffer, reused for every chunk copied in one direction.

    Allocate (and use) it under the copy stream that consumes it: PyTorch's caching
    allocator then ties its memory to that stream, so growing it while earlier copies
    are queued is safe.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self._kept: set[int] = set()  # streams the current allocation was recorded on
        self.generation = 0
        """Counts allocations: views and addresses taken from :meth:`get` hold while it is unchanged."""

    def get(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * dtype.itemsize
        if self._buf is None or self._buf.numel() < nbytes:
            grown = nbytes if self._buf is None else max(nbytes, 2 * self._buf.numel())
            self._buf = torch.empty(grown, dtype=torch.uint8, device=self.device)
            self._kept.clear()
            self.generation += 1
        return self._buf[:nbytes].view(dtype).view(shape)

    def keep_for(self, stream: torch.cuda.Stream | None) -> None:
        """Tell the caching allocator the current allocation is used on ``stream`` too
        (``record_stream``), once per allocation: the allocator keeps a block's streams
        until the block is freed, so a buffer reused by every request is recorded once,
        not per request (each call costs the host a few microseconds)."""
        buf = self._buf
        if stream is None or buf is None or buf.device.type != "cuda":
            return
        key = stream.cuda_stream
        if key not in self._kept:
            buf.record_stream(stream)
            self._kept.add(key)

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()
