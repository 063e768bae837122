"""Layerwise transfers as a two-stream pipeline: each layer's gather (store) or scatter
(load) kernel on one stream, its chunk copies on the other, so a layer's kernel runs
while its neighbour's copies are on the PCIe bus.

Owns, for one request: the token-major row indices, two device scratch buffers (layer
``i`` uses buffer ``i % 2``) with each chunk's address in them worked out once, and the
per-layer events that order the two streams, the caller's stream and the host; per
layer, the handful of calls a store or load makes. A layer's copies of LMCache-sized
chunks take ~85 us on an H100 and each torch call costs the host 1-9 us, so nothing here
is computed per layer that can be computed per request, and the copies, records and
waits go to the driver on raw handles (kvstore.gpu.driver, ~1 us each); only the gather
or scatter kernel is a torch call (see ``benchmarks/bench_gpu_layerwise.py``).

Chunks are passed as addresses: ``store_layer`` / ``load_layer`` take, per chunk, the
address of ``chunk_bytes[c]`` contiguous bytes in page-locked host memory (LMCache's
pool) or device memory; the caller has checked each object's size, shape and dtype and
keeps it alive until the layer's event completes.

Ordering (CUDA; on CPU every call runs inline, in order, copies are ``memmove`` and no
events are made):

* store, layer i: kernel stream waits for the caller's stream (the attention that wrote
  the layer) and for the copies of layer i - 2 (which read the same scratch buffer);
  gathers; the copy stream waits for the gather and copies each chunk to its object;
  ``done[i]`` marks the copies.
* load, layer i: the copy stream waits for the scatter of layer i - 2 (same buffer) and
  copies each object into scratch; the kernel stream waits for those copies and
  scatters; ``done[i]`` marks the scatter. The caller's stream waits for ``done[i]``
  before it computes layer i.

Must not touch: LMCache objects and formats (the connector passes plain tensors),
pageable-memory staging (kvstore.gpu.transfer), index arithmetic (kvstore.gpu.layout).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvstore.gpu.driver import DriverCalls
from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.staging import DeviceScratch
from kvstore.gpu.transfer import CopyStream

__all__ = ["LayerPipeline"]


class LayerPipeline:
    """One request's layerwise copies between paged caches and per-chunk host memory.

    ``spans``: each chunk's ``[a, b)`` in the request's kept tokens (the rows of
    ``rows`` are ``kv_size`` per token, token-major); ``copies`` runs the chunk copies and
    ``kernels`` the gather/scatter kernels; ``scratch`` holds the two device buffers;
    ``driver``: the driver calls (required on CUDA, unused on CPU).
    """

    def __init__(
        self,
        paged: PagedKVCache,
        rows: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        *,
        copies: CopyStream,
        kernels: CopyStream,
        scratch: Sequence[DeviceScratch],
        driver: DriverCalls | None = None,
    ) -> None:
        self.paged = paged
        self.rows = rows
        total = spans[-1][1] if spans else 0
        shape = paged.layout.layer_chunk_shape(total)
        self._buffers = [s.get(shape, paged.dtype) for s in scratch[:2]]
        views = [[buf[a:b] for a, b in spans] for buf in self._buffers]
        self.chunk_bytes = [v.numel() * v.element_size() for v in views[0]]
        """Bytes of each chunk's piece of one layer (what an address passed in must hold)."""
        self._addresses = [[v.data_ptr() for v in vs] for vs in views]
        self._words = [paged.layer_words(buf, total) for buf in self._buffers]
        self._index = paged.device.index if paged.device.index is not None else 0
        self._done = copies.events(paged.num_layers, "done")  # returned, waited for by torch
        self._driver: DriverCalls | None = None
        copy_stream, kernel_stream = copies.stream, kernels.stream
        if copy_stream is None or kernel_stream is None:
            return
        if driver is None:
            raise ValueError("a CUDA layer pipeline needs the driver calls (kvstore.gpu.driver)")
        self._driver = driver
        self._kernel_stream = kernel_stream
        self._copy_h, self._kernel_h = copy_stream.cuda_stream, kernel_stream.cuda_stream
        self._done_h = [e.cuda_event for e in self._done]
        self._ready_h = [e.cuda_event for e in kernels.events(paged.num_layers, "ready")]
        self._moved_h = [e.cuda_event for e in kernels.events(paged.num_layers, "moved")]
        caller = torch.cuda.current_stream(self._index)
        # Device memory made or last used on other streams is used on both from here on,
        # and this request's kernels and copies come after everything queued so far on
        # the caller's stream and on each other's (earlier requests' copies included).
        for t in (*self._buffers, rows):
            copies.keep(t)
            kernels.keep(t)
        for a, b in ((copy_stream, kernel_stream), (kernel_stream, copy_stream)):
            a.wait_stream(caller)
            a.wait_stream(b)

    def _copy_inline(self, dsts: Sequence[int], srcs: Sequence[int]) -> None:
        for dst, src, n in zip(dsts, srcs, self.chunk_bytes, strict=True):
            if n:
                ctypes.memmove(dst, src, n)

    # -- store: paged cache -> host memory ----------------------------------------------

    def store_layer(self, layer: int, dsts: Sequence[int]) -> torch.cuda.Event | None:
        """Queue layer ``layer``'s gather and its copies to ``dsts`` (one address per
        chunk, in ``spans`` order, ``chunk_bytes`` each); the returned event marks them
        complete."""
        b = layer % 2
        drv = self._driver
        if drv is None:  # CPU: inline
            self.paged.gather_words(layer, self.rows, self._words[b])
            self._copy_inline(dsts, self._addresses[b])
            return None
        kernel_h, copy_h = self._kernel_h, self._copy_h
        caller = torch.cuda.current_stream(self._index)
        drv.record(self._ready_h[layer], caller.cuda_stream)  # after the attention that wrote it
        drv.wait(kernel_h, self._ready_h[layer])
        if layer >= 2:
            drv.wait(kernel_h, self._done_h[layer - 2])  # whose copies read this buffer
        torch.cuda.set_stream(self._kernel_stream)
        try:
            self.paged.gather_words(layer, self.rows, self._words[b])
        finally:
            torch.cuda.set_stream(caller)
        gathered = self._moved_h[layer]
        drv.record(gathered, kernel_h)
        drv.wait(copy_h, gathered)
        for dst, src, n in zip(dsts, self._addresses[b], self.chunk_bytes, strict=True):
            if n:
                drv.copy(dst, src, n, copy_h)
        drv.record(self._done_h[layer], copy_h)
        return self._done[layer]

    # -- load: host memory -> paged cache -----------------------------------------------

    def load_layer(self, layer: int, srcs: Sequence[int], *, caller_waits: bool = False) -> torch.cuda.Event | None:
        """Queue the copies from ``srcs`` (one address per chunk, in ``spans`` order,
        ``chunk_bytes`` each) and layer ``layer``'s scatter; the returned event marks the
        scatter complete. ``caller_waits``: first make the caller's stream wait for layer
        ``layer - 1`` (the engine computes that layer next)."""
        b = layer % 2
        drv = self._driver
        if drv is None:  # CPU: inline
            self._copy_inline(self._addresses[b], srcs)
            self.paged.scatter_words(layer, self.rows, self._words[b])
            return None
        kernel_h, copy_h = self._kernel_h, self._copy_h
        caller = torch.cuda.current_stream(self._index)
        if caller_waits and layer:
            drv.wait(caller.cuda_stream, self._done_h[layer - 1])
        if layer >= 2:
            drv.wait(copy_h, self._done_h[layer - 2])  # whose scatter read this buffer
        for dst, src, n in zip(self._addresses[b], srcs, self.chunk_bytes, strict=True):
            if n:
                drv.copy(dst, src, n, copy_h)
        moved = self._moved_h[layer]
        drv.record(moved, copy_h)
        drv.wait(kernel_h, moved)
        torch.cuda.set_stream(self._kernel_stream)
        try:
            self.paged.scatter_words(layer, self.rows, self._words[b])
        finally:
            torch.cuda.set_stream(caller)
        drv.record(self._done_h[layer], kernel_h)
        return self._done[layer]

    def caller_waits(self, layer: int) -> None:
        """The caller's current stream waits for layer ``layer``'s transfer (a no-op on CPU)."""
        if self._done:
            torch.cuda.current_stream(self._index).wait_event(self._done[layer])

    def host_waits(self, layer: int) -> None:
        """Block the host until layer ``layer``'s transfer is complete."""
        if self._done:
            self._done[layer].synchronize()
