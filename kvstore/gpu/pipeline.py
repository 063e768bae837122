"""Layerwise transfers as a two-stream pipeline: each layer's gather (store) or scatter
(load) kernel on one stream, its chunk copies on the other, so a layer's kernel runs
while its neighbour's copies are on the PCIe bus.

Owns, for one request: the token-major row indices, two device scratch buffers (layer
``i`` uses buffer ``i % 2``) with one view per chunk made once, and the per-layer events
that order the two streams, the caller's stream and the host; per layer, the handful of
calls a store or load makes. A layer's copies of LMCache-sized chunks take ~85 us on an
H100 and each torch call costs the host 1-9 us, so nothing here is computed per layer
that can be computed per request (see ``benchmarks/bench_gpu_layerwise.py``).

Ordering (CUDA; on CPU every call runs inline, in order, and no events are made):

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

from collections.abc import Sequence

import torch

from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.staging import DeviceScratch
from kvstore.gpu.transfer import CopyStream

__all__ = ["LayerPipeline"]


class LayerPipeline:
    """One request's layerwise copies between paged caches and per-chunk tensors.

    ``spans``: each chunk's ``[a, b)`` in the request's kept tokens (the rows of
    ``rows`` are ``kv_size`` per token, token-major); ``copies`` runs the chunk copies and
    ``kernels`` the gather/scatter kernels; ``scratch`` holds the two device buffers.
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
    ) -> None:
        self.paged = paged
        self.rows = rows
        self.spans = list(spans)
        total = self.spans[-1][1] if self.spans else 0
        shape = paged.layout.layer_chunk_shape(total)
        self._buffers = [s.get(shape, paged.dtype) for s in scratch[:2]]
        self._views = [[buf[a:b] for a, b in self.spans] for buf in self._buffers]
        self._words = [paged.layer_words(buf, total) for buf in self._buffers]
        self._index = paged.device.index if paged.device.index is not None else 0
        self._done = copies.events(paged.num_layers, "done")
        self._ready = kernels.events(paged.num_layers, "ready")
        self._moved = kernels.events(paged.num_layers, "moved")
        self._copy_stream, self._kernel_stream = copies.stream, kernels.stream
        caller = torch.cuda.current_stream(self._index) if copies.is_async else None
        # Device memory made or last used on other streams is used on both from here on,
        # and this request's kernels and copies come after everything queued so far on
        # the caller's stream and on each other's (earlier requests' copies included).
        for t in (*self._buffers, rows):
            copies.keep(t)
            kernels.keep(t)
        if self._copy_stream is not None and self._kernel_stream is not None and caller is not None:
            for a, b in ((self._copy_stream, self._kernel_stream), (self._kernel_stream, self._copy_stream)):
                a.wait_stream(caller)
                a.wait_stream(b)

    # -- store: paged cache -> tensors --------------------------------------------------

    def store_layer(self, layer: int, dsts: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
        """Queue layer ``layer``'s gather and copies into ``dsts`` (one per chunk, in
        ``spans`` order); the returned event marks them complete."""
        b = layer % 2
        kernel, copy = self._kernel_stream, self._copy_stream
        if kernel is None or copy is None:  # CPU: inline
            self.paged.gather_words(layer, self.rows, self._words[b])
            for dst, view in zip(dsts, self._views[b], strict=True):
                dst.copy_(view)
            return None
        ready, gathered, done = self._ready[layer], self._moved[layer], self._done[layer]
        caller = torch.cuda.current_stream(self._index)
        ready.record(caller)  # after the attention that wrote this layer
        kernel.wait_event(ready)
        if layer >= 2:
            kernel.wait_event(self._done[layer - 2])  # whose copies read this buffer
        torch.cuda.set_stream(kernel)
        try:
            self.paged.gather_words(layer, self.rows, self._words[b])
            gathered.record(kernel)
            copy.wait_event(gathered)
            torch.cuda.set_stream(copy)
            for dst, view in zip(dsts, self._views[b], strict=True):
                dst.copy_(view, non_blocking=True)
            done.record(copy)
        finally:
            torch.cuda.set_stream(caller)
        return done

    # -- load: tensors -> paged cache ---------------------------------------------------

    def load_layer(
        self, layer: int, srcs: Sequence[torch.Tensor], *, caller_waits: bool = False
    ) -> torch.cuda.Event | None:
        """Queue the copies of ``srcs`` (one per chunk, in ``spans`` order) and layer
        ``layer``'s scatter; the returned event marks the scatter complete.
        ``caller_waits``: first make the caller's stream wait for layer ``layer - 1``
        (the engine computes that layer next)."""
        b = layer % 2
        kernel, copy = self._kernel_stream, self._copy_stream
        if kernel is None or copy is None:  # CPU: inline
            for src, view in zip(srcs, self._views[b], strict=True):
                view.copy_(src)
            self.paged.scatter_words(layer, self.rows, self._words[b])
            return None
        moved, done = self._moved[layer], self._done[layer]
        caller = torch.cuda.current_stream(self._index)
        if caller_waits and layer:
            caller.wait_event(self._done[layer - 1])
        if layer >= 2:
            copy.wait_event(self._done[layer - 2])  # whose scatter read this buffer
        torch.cuda.set_stream(copy)
        try:
            for src, view in zip(srcs, self._views[b], strict=True):
                view.copy_(src, non_blocking=True)
            moved.record(copy)
            kernel.wait_event(moved)
            torch.cuda.set_stream(kernel)
            self.paged.scatter_words(layer, self.rows, self._words[b])
            done.record(kernel)
        finally:
            torch.cuda.set_stream(caller)
        return done

    def caller_waits(self, layer: int) -> None:
        """The caller's current stream waits for layer ``layer``'s transfer (a no-op on CPU)."""
        if self._done:
            torch.cuda.current_stream(self._index).wait_event(self._done[layer])

    def host_waits(self, layer: int) -> None:
        """Block the host until layer ``layer``'s transfer is complete."""
        if self._done:
            self._done[layer].synchronize()
