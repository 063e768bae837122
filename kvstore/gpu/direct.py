"""Paged KV cache <-> memory objects as one row copy per transfer.

Owns: when the direct path applies (memory objects contiguous, of the caches' dtype,
exactly their chunk's shape, in the caches' device memory or, for CUDA caches, pinned
host memory), and the per-chunk table the row copy reads: for each chunk the slot-mapping
position of its first moved token, the object address of that token's first row, the
bytes between the object's planes and the number of tokens moved. Whatever the number of
layers and chunks, a transfer is that table (one small asynchronous upload) plus one
launch of :func:`kvstore.gpu.rowcopy.copy_paged_rows`:

* whole chunks (``KV_2LTD`` ``[K, L, T, W]``): planes ``(k, layer)``, one launch a batch;
* layerwise (``KV_T2D`` ``[T, K, W]``): planes ``k``, one launch a layer.

Must not touch: streams and host waits (kvstore.gpu.transfer / connector), memory-object
formats and LMCache objects (connector), the row arithmetic (layout / rowcopy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.rowcopy import PagedRows, copy_paged_rows, kernel_available, word_bytes

__all__ = ["DirectCopier", "LayerCopies", "TokenSpans"]


class TokenSpans:
    """The tokens a batch moves, chunk by chunk (a few host ints per chunk).

    ``first[c]``: slot-mapping position of chunk ``c``'s first moved token; ``skips[c]``:
    tokens at the front of its object that stay out (vLLM already has them);
    ``lengths[c]``: the object's token count ``T``; ``end``: the slot mapping must hold
    at least this many tokens.
    """

    def __init__(self, first: list[int], skips: list[int], lengths: list[int], end: int) -> None:
        self.first, self.skips, self.lengths, self.end = first, skips, lengths, end
        self.kept = [n - k for n, k in zip(lengths, skips, strict=True)]
        self.num_tokens = sum(self.kept)

    @classmethod
    def of(cls, starts: Sequence[int], ends: Sequence[int], skips: Sequence[int] | None = None) -> TokenSpans:
        skips = [int(k) for k in skips] if skips is not None else [0] * len(starts)
        lengths = [int(e) - int(s) for s, e in zip(starts, ends, strict=True)]
        first = [int(s) + k for s, k in zip(starts, skips, strict=True)]
        return cls(first, skips, lengths, max((int(e) for e in ends), default=0))


class _Uploader:
    """Small host->device copies (the per-chunk tables) through one reused pinned buffer,
    so they are asynchronous; the buffer is rewritten only once the copy that last read
    it has finished. On CPU a plain ``to``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def send(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        if self._event is not None:
            self._event.synchronize()
        n = t.numel()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(
                max(n, 2 * (0 if self._buf is None else self._buf.numel())),
                dtype=torch.int64,
                pin_memory=True,
            )
        staged = self._buf[:n].view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return out


class DirectCopier:
    """The one-launch row copy for one bound set of paged caches."""

    def __init__(self, paged: PagedKVCache) -> None:
        self.paged = paged
        lay = paged.layout
        self.row_bytes = lay.width * lay.dtype.itemsize
        layer_ptrs = [t.data_ptr() for t in paged.kv_caches]
        self._layer_addr = torch.tensor(layer_ptrs, dtype=torch.int64).to(paged.device)
        self._layer_gcd = math.gcd(self.row_bytes, *layer_ptrs)
        self._upload = _Uploader(paged.device)

    # -- eligibility ------------------------------------------------------------------

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when every tensor can be read/written by address from the caches' device."""
        dev = self.paged.device
        for t in tensors:
            if not t.is_contiguous() or t.dtype != self.paged.dtype:
                return False
            if t.device == dev:
                continue
            if not (dev.type == "cuda" and t.device.type == "cpu" and t.is_pinned()):
                return False
        return True

    @staticmethod
    def runnable(device: torch.device) -> bool:
        """True when the copy can run for caches on ``device`` without being forced."""
        return device.type == "cuda" and kernel_available()

    def _check(self, tensors: Sequence[torch.Tensor], spans: TokenSpans, shape_of) -> None:
        """Raw addresses overrun nothing: each object has exactly its chunk's shape."""
        if len(tensors) != len(spans.lengths):
            raise ValueError(f"{len(tensors)} memory objects for {len(spans.lengths)} chunks")
        for i, (t, n) in enumerate(zip(tensors, spans.lengths, strict=True)):
            want = tuple(shape_of(n))
            if tuple(t.shape) != want:
                raise ValueError(f"memory object {i} has shape {tuple(t.shape)}, expected {want}")

    def _slots(self, slot_mapping: torch.Tensor, spans: TokenSpans) -> torch.Tensor:
        """The slot mapping as int64 on the caches' device, checked to cover ``spans``."""
        if spans.end > slot_mapping.numel():
            raise ValueError(
                f"chunks reach token {spans.end} but slot_mapping holds {slot_mapping.numel()} tokens"
            )
        return self.paged.slots(slot_mapping)

    def _tables(
        self,
        spans: TokenSpans,
        groups: Sequence[Sequence[torch.Tensor]],
        row_step: int,
        plane_bytes: list[int],
    ) -> torch.Tensor:
        """``[G, 4, C]`` tables, one per group of per-chunk objects, on the caches' device.
        A chunk's first moved row sits ``skip * row_step`` bytes into its object."""
        first_row = [
            [t.data_ptr() + k * row_step for t, k in zip(g, spans.skips, strict=True)] for g in groups
        ]
        table = [[spans.first, row, plane_bytes, spans.kept] for row in first_row]
        return self._upload.send(torch.tensor(table, dtype=torch.int64))

    def _copy(
        self,
        slots: torch.Tensor,
        table: torch.Tensor,
        spans: TokenSpans,
        tensors: Sequence[torch.Tensor],
        layer: int | None,
        to_cache: bool,
    ) -> None:
        lay = self.paged.layout
        k_stride, block = lay.row_terms()
        rows = PagedRows(
            slot_mapping=slots,
            layer_addr=self._layer_addr,
            meta=table,
            max_tokens=max(spans.kept, default=0),
            planes=lay.kv_size * lay.num_layers if layer is None else lay.kv_size,
            layer=layer,
            num_layers=lay.num_layers,
            k_stride=k_stride,
            block_size=block,
            kv_size=lay.kv_size,
            token_stride=self.row_bytes if layer is None else self.row_bytes * lay.kv_size,
        )
        word = word_bytes(self._layer_gcd, [t.data_ptr() for t in tensors])
        copy_paged_rows(rows, self.row_bytes, word, to_cache=to_cache)

    # -- whole chunks: [K, L, T, W] --------------------------------------------------

    def chunks(
        self,
        slot_mapping: torch.Tensor,
        spans: TokenSpans,
        tensors: Sequence[torch.Tensor],
        *,
        to_cache: bool,
    ) -> None:
        """Copy the kept tokens of every chunk between the caches and ``tensors``
        (``tensors[i]`` is chunk ``i``'s ``[K, L, T_i, W]``) in one launch."""
        self._check(tensors, spans, self.paged.layout.chunk_shape)
        if spans.num_tokens == 0:
            return
        rb = self.row_bytes
        slots = self._slots(slot_mapping, spans)
        table = self._tables(spans, [tensors], rb, [n * rb for n in spans.lengths])[0]
        self._copy(slots, table, spans, tensors, None, to_cache)

    # -- one layer at a time: [T, K, W] (MLA [T, W]) --------------------------------------

    def layers(self, slot_mapping: torch.Tensor, spans: TokenSpans) -> LayerCopies:
        """The per-layer copies of one layerwise batch."""
        return LayerCopies(self, self._slots(slot_mapping, spans), spans)


class LayerCopies:
    """One layerwise batch: :meth:`prepare` (optional) sends every layer's table at once;
    :meth:`copy` moves one layer's rows in one launch."""

    def __init__(self, copier: DirectCopier, slots: torch.Tensor, spans: TokenSpans) -> None:
        self.copier, self.slots, self.spans = copier, slots, spans
        self._tables: torch.Tensor | None = None  # [L, 4, C] once prepared

    def _tables_for(self, groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        copier = self.copier
        lay = copier.paged.layout
        for group in groups:
            copier._check(group, self.spans, lay.layer_chunk_shape)
        rb = copier.row_bytes
        return copier._tables(self.spans, groups, rb * lay.kv_size, [rb] * len(self.spans.lengths))

    def prepare(self, tensors: Sequence[Sequence[torch.Tensor]]) -> None:
        """Every layer's objects known up front (stores): one upload for all of them."""
        self._tables = self._tables_for(tensors)

    def copy(self, layer: int, tensors: Sequence[torch.Tensor], *, to_cache: bool) -> None:
        if self.spans.num_tokens == 0:
            return
        table = self._tables[layer] if self._tables is not None else self._tables_for([tensors])[0]
        self.copier._copy(self.slots, table, self.spans, tensors, layer, to_cache)
