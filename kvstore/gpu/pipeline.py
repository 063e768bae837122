"""Layerwise transfers as a two-stream pipeline: each layer's gather (store) or scatter
(load) kernel on one stream, its chunk copies on the other, so a layer's kernel runs
while its neighbour's copies are on the PCIe bus.

Owns, for one request: its token-major row indices, each chunk's address in the two
device scratch buffers, and the per-layer calls a store or load makes. The buffers, the
streams and the events that order them with the caller's stream and the host are a
direction's, shared by every request of it (a :class:`PipelinePlan` holds what a
request works out from them, and the next request of the same geometry reuses it). A
layer's copies of LMCache-sized chunks take ~85 us on an H100 and each torch call costs
the host 1-9 us (2-4x that inside a pass), so nothing here is computed per layer that
can be computed per request, and the copies, records and waits go to the driver on raw
handles (kvstore.gpu.driver, ~1 us each); only the gather or scatter kernel is a torch
call (see ``benchmarks/bench_gpu_layerwise.py`` and ``bench_gpu_setup.py``).

Chunks are passed as addresses: ``store_layer`` / ``load_layer`` take, per chunk, the
address of ``chunk_bytes[c]`` contiguous bytes in page-locked host memory (LMCache's
pool) or device memory; the caller has checked each object's size, shape and dtype and
keeps it alive until the layer's event completes.

Ordering (CUDA; on CPU every call runs inline, in order, copies are ``memmove`` and no
events are made). Each queued layer takes the direction's next buffer ``b`` in turn
(:class:`BufferTurn`: one request alone alternates, as ``i % 2``):

* store, layer i: the kernel stream waits for the caller's stream (the attention that
  wrote the layer) and for ``free[b]``, the last copies queued out of buffer ``b`` (by
  any request); gathers; the copy stream waits for the gather and copies each chunk to
  its object; ``done[i]`` and ``free[b]`` mark the copies.
* load, layer i: the copy stream waits for ``free[b]``, the last scatter queued out of
  buffer ``b`` (by any request), and copies each object into it; the kernel stream waits
  for those copies (and, at the first scatter, for the row indices when they are
  made lazily, on the caller's stream after the first copies were queued) and scatters; ``done[i]`` and
  ``free[b]`` mark the scatter. The caller's stream waits for ``done[i]`` before it
  computes layer i.

Requests share all of this because LMCache's vLLM adapter steps the generators of every
request in a batch one layer at a time (A's layer 1, B's layer 1, A's layer 2, ...):
waiting for a buffer's last user, whoever it was, keeps B's gather from overwriting rows
A's copies have yet to read, and taking buffers in turn across requests lets B's gather
run beside A's copies. The other events are a direction's too, each recorded and waited
for in one call, except ``done[i]``, recorded on one stream per direction: a wait on it
waits for the last request that queued layer i, after this one's on that stream, so
never for less. LMCache relies on that: only one request of a batch has ``sync=True``,
and its waits must cover the others' layers.

Must not touch: LMCache objects and formats (the connector passes plain tensors),
pageable-memory staging (kvstore.gpu.transfer), index arithmetic (kvstore.gpu.layout).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.gpu.driver import DriverCalls
from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.staging import DeviceScratch
from kvstore.gpu.transfer import CopyStream

__all__ = ["BufferTurn", "LayerPipeline", "PipelinePlan"]


class BufferTurn:
    """Which of a direction's two scratch buffers the next queued layer takes, whichever
    request queues it (one thread queues a direction's layers: LMCache's forward thread)."""

    def __init__(self) -> None:
        self._next = 0

    def take(self) -> int:
        b = self._next
        self._next = b ^ 1
        return b


@dataclass(eq=False)
class PipelinePlan:
    """What a layer pipeline works out from a request's geometry once: the scratch
    buffers as word rows, each chunk's address and size in them, the events and their
    raw handles. The next request of the same geometry (same caches, chunk spans,
    streams, and scratch allocations) takes it as it is: on a busy host each torch call
    of a request's set-up costs 10-40 us, all before its first copy is queued."""

    paged: PagedKVCache
    spans: tuple[tuple[int, int], ...]
    copies: CopyStream
    kernels: CopyStream
    scratch: tuple[tuple[DeviceScratch, int], ...]  # (scratch, its allocation's generation)
    chunk_bytes: list[int]
    addresses: list[list[int]]  # [buffer][chunk]
    words: list[torch.Tensor]  # each buffer as the word rows the kernels move
    done: list[torch.cuda.Event] = field(default_factory=list)
    done_h: list[int] = field(default_factory=list)
    ready_h: list[int] = field(default_factory=list)
    moved_h: list[int] = field(default_factory=list)
    start_h: tuple[int, int, int] = (0, 0, 0)  # caller's stream, copy stream, kernel stream
    free_h: tuple[int, int] = (0, 0)  # each buffer's last reader queued, of any request
    rows_h: int = 0

    def fits(
        self,
        paged: PagedKVCache,
        spans: tuple[tuple[int, int], ...],
        copies: CopyStream,
        kernels: CopyStream,
        scratch: Sequence[DeviceScratch],
    ) -> bool:
        return (
            self.paged is paged
            and self.copies is copies
            and self.kernels is kernels
            and self.spans == spans
            and len(scratch) >= 2
            and all(s is t and s.generation == g for (t, g), s in zip(self.scratch, scratch[:2], strict=True))
        )

    @classmethod
    def make(
        cls,
        paged: PagedKVCache,
        spans: tuple[tuple[int, int], ...],
        copies: CopyStream,
        kernels: CopyStream,
        scratch: Sequence[DeviceScratch],
    ) -> PipelinePlan:
        total = spans[-1][1] if spans else 0
        shape = paged.layout.layer_chunk_shape(total)
        buffers = [s.get(shape, paged.dtype) for s in scratch[:2]]
        # A chunk's piece of a layer buffer is rows [a, b) of a contiguous [T, ...]
        # tensor: its address and size are arithmetic, no view per chunk.
        token_bytes = buffers[0].nbytes // total if total else 0
        plan = cls(
            paged,
            spans,
            copies,
            kernels,
            tuple((s, s.generation) for s in scratch[:2]),
            [(b - a) * token_bytes for a, b in spans],
            [[buf.data_ptr() + a * token_bytes for a, _ in spans] for buf in buffers],
            [paged.layer_words(buf, total) for buf in buffers],
            copies.events(paged.num_layers, "done"),  # returned, waited for by torch
        )
        if copies.stream is None or kernels.stream is None:
            return plan
        # Scratch memory made on the caller's stream is used on both (recorded once per
        # allocation: the allocator keeps a block's streams until it is freed).
        for s in scratch[:2]:
            s.keep_for(copies.stream)
            s.keep_for(kernels.stream)
        plan.done_h = copies.handles(paged.num_layers, "done")
        plan.ready_h = kernels.handles(paged.num_layers, "ready")
        plan.moved_h = kernels.handles(paged.num_layers, "moved")
        a, b, c, d = kernels.handles(4, "start")
        plan.start_h, plan.rows_h = (a, b, c), d
        # Kept by the direction's kernel stream, shared by every request of it (as are the
        # buffers these events guard): see "Ordering" above.
        free_a, free_b = kernels.handles(2, "free")
        plan.free_h = (free_a, free_b)
        return plan


class LayerPipeline:
    """One request's layerwise copies between paged caches and per-chunk host memory.

    ``spans``: each chunk's ``[a, b)`` in the request's kept tokens (the rows of
    ``rows`` are ``kv_size`` per token, token-major; ``rows`` may be a callable that makes
    them on the caller's stream, called when the first gather or scatter is queued: a
    load's first copies then start before the host works them out); ``copies`` runs the
    chunk copies and ``kernels`` the gather/scatter kernels; ``scratch`` holds the two
    device buffers; ``driver``: the driver calls (required on CUDA, unused on CPU);
    ``reuse``: the previous request's :attr:`plan`, taken when it fits this one;
    ``turn``: the direction's :class:`BufferTurn` (every request of a direction must share
    one, with the scratch buffers and streams).
    """

    def __init__(
        self,
        paged: PagedKVCache,
        rows: torch.Tensor | Callable[[], torch.Tensor],
        spans: Sequence[tuple[int, int]],
        *,
        copies: CopyStream,
        kernels: CopyStream,
        scratch: Sequence[DeviceScratch],
        driver: DriverCalls | None = None,
        reuse: PipelinePlan | None = None,
        turn: BufferTurn | None = None,
    ) -> None:
        self.paged = paged
        self._turn = turn if turn is not None else BufferTurn()
        # A callable makes the rows on the caller's stream when the first scatter needs
        # them: a load queues its first layer's copies before (they need no rows), so the
        # copy engine starts while the host works out the request's row indices.
        self._make_rows = None if isinstance(rows, torch.Tensor) else rows
        self.rows: torch.Tensor | None = rows if isinstance(rows, torch.Tensor) else None
        key = tuple(spans)
        if reuse is None or not reuse.fits(paged, key, copies, kernels, scratch):
            reuse = PipelinePlan.make(paged, key, copies, kernels, scratch)
        self.plan = plan = reuse
        """The request's geometry worked out (pass it as ``reuse`` to the next request)."""
        self.chunk_bytes = plan.chunk_bytes
        """Bytes of each chunk's piece of one layer (what an address passed in must hold)."""
        self._addresses, self._words, self._done = plan.addresses, plan.words, plan.done
        self._index = paged.device.index if paged.device.index is not None else 0
        self._driver: DriverCalls | None = None
        copy_stream, kernel_stream = copies.stream, kernels.stream
        if copy_stream is None or kernel_stream is None:
            return
        if driver is None:
            raise ValueError("a CUDA layer pipeline needs the driver calls (kvstore.gpu.driver)")
        self._driver = driver
        self._kernels, self._kernel_stream = kernels, kernel_stream
        self._copy_h, self._kernel_h = copy_stream.cuda_stream, kernel_stream.cuda_stream
        self._done_h, self._ready_h, self._moved_h = plan.done_h, plan.ready_h, plan.moved_h
        self._free_h = plan.free_h
        if self.rows is not None:  # made on the caller's stream, read on the kernel stream
            kernels.keep(self.rows)
        # This request's kernels and copies come after everything queued so far on the
        # caller's stream and on each other's (earlier requests' copies and kernels read
        # and write the same scratch buffers): three records and four waits on the
        # driver, where torch's wait_stream would make and record an event per wait.
        at_caller, at_copies, at_kernels = plan.start_h
        caller_h = torch.cuda.current_stream(self._index).cuda_stream
        driver.record(at_caller, caller_h)
        driver.record(at_copies, self._copy_h)
        driver.record(at_kernels, self._kernel_h)
        driver.wait(self._copy_h, at_caller)
        driver.wait(self._copy_h, at_kernels)
        driver.wait(self._kernel_h, at_caller)
        driver.wait(self._kernel_h, at_copies)

    def _rows(self, caller_h: int | None) -> torch.Tensor:
        """The request's row indices, made on the caller's stream at the first call
        (``caller_h``: that stream's handle on CUDA; the kernel stream then waits for it)."""
        if self.rows is not None:
            return self.rows
        assert self._make_rows is not None
        rows = self.rows = self._make_rows()
        if caller_h is not None and self._driver is not None:
            self._kernels.keep(rows)
            made = self.plan.rows_h
            self._driver.record(made, caller_h)
            self._driver.wait(self._kernel_h, made)
        return rows

    def _copy_inline(self, dsts: Sequence[int], srcs: Sequence[int]) -> None:
        for dst, src, n in zip(dsts, srcs, self.chunk_bytes, strict=True):
            if n:
                ctypes.memmove(dst, src, n)

    # -- store: paged cache -> host memory ----------------------------------------------

    def store_layer(self, layer: int, dsts: Sequence[int]) -> torch.cuda.Event | None:
        """Queue layer ``layer``'s gather and its copies to ``dsts`` (one address per
        chunk, in ``spans`` order, ``chunk_bytes`` each); the returned event marks them
        complete."""
        b = self._turn.take()
        drv = self._driver
        if drv is None:  # CPU: inline
            self.paged.gather_words(layer, self._rows(None), self._words[b])
            self._copy_inline(dsts, self._addresses[b])
            return None
        kernel_h, copy_h = self._kernel_h, self._copy_h
        caller = torch.cuda.current_stream(self._index)
        drv.record(self._ready_h[layer], caller.cuda_stream)  # after the attention that wrote it
        drv.wait(kernel_h, self._ready_h[layer])
        drv.wait(kernel_h, self._free_h[b])  # the copies last queued out of this buffer
        rows = self._rows(caller.cuda_stream)
        torch.cuda.set_stream(self._kernel_stream)
        try:
            self.paged.gather_words(layer, rows, self._words[b])
        finally:
            torch.cuda.set_stream(caller)
        gathered = self._moved_h[layer]
        drv.record(gathered, kernel_h)
        drv.wait(copy_h, gathered)
        for dst, src, n in zip(dsts, self._addresses[b], self.chunk_bytes, strict=True):
            if n:
                drv.copy(dst, src, n, copy_h)
        drv.record(self._done_h[layer], copy_h)
        drv.record(self._free_h[b], copy_h)
        return self._done[layer]

    # -- load: host memory -> paged cache -----------------------------------------------

    def load_layer(self, layer: int, srcs: Sequence[int], *, caller_waits: bool = False) -> torch.cuda.Event | None:
        """Queue the copies from ``srcs`` (one address per chunk, in ``spans`` order,
        ``chunk_bytes`` each) and layer ``layer``'s scatter; the returned event marks the
        scatter complete. ``caller_waits``: first make the caller's stream wait for layer
        ``layer - 1`` (the engine computes that layer next)."""
        b = self._turn.take()
        drv = self._driver
        if drv is None:  # CPU: inline
            self._copy_inline(self._addresses[b], srcs)
            self.paged.scatter_words(layer, self._rows(None), self._words[b])
            return None
        kernel_h, copy_h = self._kernel_h, self._copy_h
        caller = torch.cuda.current_stream(self._index)
        if caller_waits and layer:
            drv.wait(caller.cuda_stream, self._done_h[layer - 1])
        drv.wait(copy_h, self._free_h[b])  # the scatter last queued out of this buffer
        for dst, src, n in zip(self._addresses[b], srcs, self.chunk_bytes, strict=True):
            if n:
                drv.copy(dst, src, n, copy_h)
        moved = self._moved_h[layer]
        drv.record(moved, copy_h)
        drv.wait(kernel_h, moved)
        rows = self._rows(caller.cuda_stream)  # (the first layer's copies are queued)
        torch.cuda.set_stream(self._kernel_stream)
        try:
            self.paged.scatter_words(layer, rows, self._words[b])
        finally:
            torch.cuda.set_stream(caller)
        drv.record(self._done_h[layer], kernel_h)
        drv.record(self._free_h[b], kernel_h)
        return self._done[layer]

    def caller_waits(self, layer: int) -> None:
        """The caller's current stream waits for layer ``layer``'s transfer (a no-op on CPU)."""
        if self._done:
            torch.cuda.current_stream(self._index).wait_event(self._done[layer])

    def host_waits(self, layer: int) -> None:
        """Block the host until layer ``layer``'s transfer is complete."""
        if self._done:
            self._done[layer].synchronize()
