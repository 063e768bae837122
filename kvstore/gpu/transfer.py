"""Ordering of copies between the serving engine's device and host memory.

Owns: the dedicated copy stream (CUDA) and its events, and :class:`HostBatch`, the
device<->host copies of one request: non-blocking DMA straight into/out of pinned
memory, or through a pooled pinned staging buffer when the host tensor is pageable.
Every synchronisation point is an explicit call here (``complete``, ``mark``,
``CopyStream.synchronize``); nothing else in kvstore.gpu waits on the device.

On CPU there is no stream: copies run inline, events are ``None`` and waits are
no-ops, so the same code paths run in CI.

Must not touch: KV layouts and index arithmetic (kvstore.gpu.layout / paged).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvstore.gpu.staging import PinnedPool, StagingBuffer

__all__ = ["CopyStream", "HostBatch"]


class CopyStream:
    """A dedicated CUDA stream for KV copies; an inline no-op on other devices."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._events: dict[str, list[torch.cuda.Event]] = {}
        self._handles: dict[str, list[int]] = {}

    @property
    def is_async(self) -> bool:
        return self.stream is not None

    @contextmanager
    def scope(self, *, after_current: bool = True) -> Iterator[None]:
        """Run the body's device work on the copy stream.

        ``after_current``: first make the copy stream wait for the work already queued on
        the caller's stream (the attention that produced the KV being stored).
        """
        if self.stream is None:
            yield
            return
        if after_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def keep(self, t: torch.Tensor) -> None:
        """Tell the caching allocator ``t`` (made on another stream) is used on this one."""
        if self.stream is not None and t.device.type == "cuda":
            t.record_stream(self.stream)

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything queued on the copy stream so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def events(self, n: int, tag: str) -> list[torch.cuda.Event]:
        """``n`` events kept under ``tag`` for reuse (made once; each request re-records
        them, which is safe: a wait takes the record in place when the wait is queued);
        none on CPU. Each is recorded once when made, so its ``cuda_event`` handle exists
        (torch creates the CUDA event at its first record)."""
        if self.stream is None:
            return []
        have = self._events.setdefault(tag, [])
        while len(have) < n:
            event = torch.cuda.Event()
            event.record(self.stream)
            have.append(event)
        return have[:n]

    def handles(self, n: int, tag: str) -> list[int]:
        """The raw ``cudaEvent_t`` handles of :meth:`events` ``(n, tag)``, read once (a
        handle is fixed for an event's life; reading it costs ~0.2 us a time)."""
        have = self._handles.get(tag)
        if have is None or len(have) < n:
            have = self._handles[tag] = [e.cuda_event for e in self.events(n, tag)]
        return have[:n]

    def synchronize(self) -> None:
        """Block the host until the copy stream is drained."""
        if self.stream is not None:
            self.stream.synchronize()

    def current_waits(self, event: torch.cuda.Event | None = None) -> None:
        """Make the caller's (compute) stream wait for ``event`` or the whole copy stream."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        if event is not None:
            current.wait_event(event)
        else:
            current.wait_stream(self.stream)


def _host_dma_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_pinned()


class HostBatch:
    """Device<->host copies of one request, with their staging buffers.

    ``to_host`` / ``to_device`` queue copies on the current stream (call them inside
    :meth:`CopyStream.scope`). Pinned host tensors are copied directly and
    asynchronously; pageable ones go through a staging buffer from the pool.
    ``mark`` tags the staging buffers used so far with an event; ``complete`` waits
    for it, finishes the pageable device->host copies and returns the buffers.
    ``stage_all`` stages every host tensor, pinned or not (tests use it on CPU to run
    the staging bookkeeping without a GPU).
    """

    def __init__(self, stream: CopyStream, pool: PinnedPool, *, stage_all: bool = False) -> None:
        self.stream = stream
        self.pool = pool
        self.stage_all = stage_all
        self._unflushed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staged view, host dst)
        self._unmarked: list[StagingBuffer] = []
        self._marked: list[tuple[StagingBuffer, torch.cuda.Event | None]] = []
        self.staged_bytes = 0

    @property
    def has_host_copies_pending(self) -> bool:
        """True while staged device->host copies still await :meth:`complete`."""
        return bool(self._unflushed)

    def _direct(self, host: torch.Tensor) -> bool:
        return not self.stage_all and (_host_dma_ready(host) or not self.stream.is_async)

    def _staged(self, like: torch.Tensor) -> tuple[StagingBuffer, torch.Tensor]:
        nbytes = like.numel() * like.element_size()
        buf = self.pool.acquire(nbytes)
        self._unmarked.append(buf)
        self.staged_bytes += nbytes
        return buf, buf.view(like.shape, like.dtype)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (device -> host); ``dst`` is valid after :meth:`complete`."""
        if self._direct(dst):
            dst.copy_(src, non_blocking=True)
            return
        _, view = self._staged(dst)
        view.copy_(src, non_blocking=True)
        self._unflushed.append((view, dst))

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (host -> device); ``src`` may be reused after this returns
        when it was staged, after :meth:`complete` when it was pinned."""
        if self._direct(src):
            dst.copy_(src, non_blocking=True)
            return
        _, view = self._staged(src)
        view.copy_(src)  # host memcpy into the pinned buffer, then DMA from it
        dst.copy_(view, non_blocking=True)

    def mark(self) -> torch.cuda.Event | None:
        """Record an event covering the copies queued so far; tag their staging buffers."""
        event = self.stream.record()
        self._marked.extend((buf, event) for buf in self._unmarked)
        self._unmarked.clear()
        return event

    def complete(self, event: torch.cuda.Event | None = None) -> None:
        """Wait for ``event`` (default: everything queued), then finish staged copies to
        the host and give every staging buffer back to the pool."""
        if event is None:
            event = self.mark()
        if event is not None:
            event.synchronize()
        for view, dst in self._unflushed:
            dst.copy_(view)
        self._unflushed.clear()
        self.release()

    def release(self) -> None:
        """Give staging buffers back; each is reused only after its own event completes."""
        if self._unmarked:
            self.mark()
        for buf, event in self._marked:
            self.pool.release(buf, event)
        self._marked.clear()
