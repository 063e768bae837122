"""Paged KV cache <-> memory objects as one row copy per transfer.

Owns: when the direct path applies (memory objects contiguous, of the caches' dtype,
in the caches' device memory or, for CUDA caches, pinned host memory), and the byte
address of every row a transfer moves, built with a fixed handful of vectorised ops
whatever the number of layers and chunks:

* whole chunks (``KV_2LTD`` ``[K, L, T, W]``): rows ``(k, layer, token)`` of each chunk;
* one layer of a layerwise batch (``KV_T2D`` ``[T, K, W]``): rows ``(token, k)``.

The cache side of an address comes from :mod:`kvstore.gpu.layout` (which row holds a
token); the object side is the object's base address plus its row offset, computed on
the host and sent with one small copy. :func:`kvstore.gpu.rowcopy.copy_rows` then moves
every row in one launch: on CUDA the gather and the PCIe transfer are one pass over the
data, with no device scratch and no per-layer launches.

Must not touch: streams and host waits (kvstore.gpu.transfer / connector), memory-object
formats and LMCache objects (connector).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.rowcopy import PagedRows, copy_paged_rows, copy_rows, kernel_available, word_bytes

__all__ = ["DirectCopier", "LayerCopies", "TokenSpans"]


class TokenSpans:
    """The tokens a batch moves, chunk by chunk: a few host ints per chunk, expanded to
    one entry per token by :meth:`ramp` (one ``repeat_interleave`` and one add each).

    ``first[c]``: slot-mapping position of chunk ``c``'s first moved token; ``skips[c]``:
    tokens at the front of its object that stay out (vLLM already has them);
    ``lengths[c]``: the object's token count ``T``; ``end``: the slot mapping must hold
    at least this many tokens.
    """

    def __init__(self, first: list[int], skips: list[int], lengths: list[int], end: int) -> None:
        self.first, self.skips, self.lengths, self.end = first, skips, lengths, end
        self.kept = [n - k for n, k in zip(lengths, skips, strict=True)]
        self.num_tokens = sum(self.kept)
        self._per_token: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, starts: Sequence[int], ends: Sequence[int], skips: Sequence[int] | None = None) -> TokenSpans:
        skips = [int(k) for k in skips] if skips is not None else [0] * len(starts)
        lengths = [int(e) - int(s) for s, e in zip(starts, ends, strict=True)]
        first = [int(s) + k for s, k in zip(starts, skips, strict=True)]
        return cls(first, skips, lengths, max((int(e) for e in ends), default=0))

    def ramp(self, values: torch.Tensor | list[int] | list[list[int]], step: int) -> torch.Tensor:
        """Per moved token ``i`` of chunk ``c``: ``values[..., c] + step * r`` where ``r``
        counts the chunk's moved tokens from 0. ``values`` is ``[..., C]``; returns ``[..., N]``."""
        if self._per_token is None:  # only the address-tensor path expands per token
            begin, at = [], 0
            for n in self.kept:
                begin.append(at)
                at += n
            self._per_token = (
                torch.tensor(begin, dtype=torch.int64),
                torch.tensor(self.kept, dtype=torch.int64),
                torch.arange(self.num_tokens, dtype=torch.int64),
            )
        begin_t, kept_t, index = self._per_token
        v = torch.as_tensor(values, dtype=torch.int64)
        expanded = torch.repeat_interleave(v - step * begin_t, kept_t, dim=-1)
        return expanded + step * index if step else expanded


class _Uploader:
    """Small host->device copies (addresses, positions) through one reused pinned buffer,
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


def _interpreting() -> bool:
    """Triton's CPU interpreter is on (tests run the fused kernel on host tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class DirectCopier:
    """Row addresses and the one-launch copy for one bound set of paged caches.

    On CUDA (or under Triton's interpreter) the fused kernel finds both addresses of
    every row itself from a ``[4, C]`` per-chunk table; elsewhere the addresses are built
    here as tensors and a host loop copies the rows. ``FUSED`` overrides the choice
    (benchmarks compare the two).
    """

    FUSED: bool | None = None

    def __init__(self, paged: PagedKVCache) -> None:
        self.paged = paged
        lay = paged.layout
        self.row_bytes = lay.width * lay.dtype.itemsize
        self._layer_ptrs = [t.data_ptr() for t in paged.kv_caches]
        self._layer_addr = torch.tensor(self._layer_ptrs, dtype=torch.int64).to(paged.device)
        self._planes = torch.arange(lay.kv_size * lay.num_layers, dtype=torch.int64).to(paged.device)
        self._upload = _Uploader(paged.device)
        self._layer_gcd = math.gcd(self.row_bytes, *self._layer_ptrs)
        auto = kernel_available() and (paged.device.type == "cuda" or _interpreting())
        self.fused = auto if self.FUSED is None else self.FUSED

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

    def _word(self, tensors: Sequence[torch.Tensor]) -> int:
        return word_bytes(self._layer_gcd, [t.data_ptr() for t in tensors])

    def _copy(
        self, cache: torch.Tensor, objs: torch.Tensor, tensors: Sequence[torch.Tensor], to_cache: bool
    ) -> None:
        word = self._word(tensors)
        if to_cache:
            copy_rows(objs, cache, self.row_bytes, word)
        else:
            copy_rows(cache, objs, self.row_bytes, word)

    def _check(self, tensors: Sequence[torch.Tensor], spans: TokenSpans, shape_of) -> None:
        """Raw addresses overrun nothing: each object has exactly its chunk's shape."""
        if len(tensors) != len(spans.lengths):
            raise ValueError(f"{len(tensors)} memory objects for {len(spans.lengths)} chunks")
        for i, (t, n) in enumerate(zip(tensors, spans.lengths, strict=True)):
            want = tuple(shape_of(n))
            if tuple(t.shape) != want:
                raise ValueError(f"memory object {i} has shape {tuple(t.shape)}, expected {want}")

    def slots(self, slot_mapping: torch.Tensor, spans: TokenSpans) -> torch.Tensor:
        """The slot mapping as int64 on the caches' device, checked to cover ``spans``."""
        if spans.end > slot_mapping.numel():
            raise ValueError(
                f"chunks reach token {spans.end} but slot_mapping holds {slot_mapping.numel()} tokens"
            )
        return self.paged.slots(slot_mapping)

    def _meta(self, spans: TokenSpans, first_row: list[list[int]], plane_bytes: list[int]) -> torch.Tensor:
        """``[G, 4, C]`` per-chunk table of the fused kernel (see rowcopy.PagedRows)."""
        return self._upload.send(
            torch.tensor(
                [[spans.first, row, plane_bytes, spans.kept] for row in first_row], dtype=torch.int64
            )
        )

    def _paged_rows(
        self, slots: torch.Tensor, meta: torch.Tensor, spans: TokenSpans, layer: int | None
    ) -> PagedRows:
        lay = self.paged.layout
        k_stride, block = lay.row_terms()
        whole = layer is None
        return PagedRows(
            slot_mapping=slots,
            layer_addr=self._layer_addr,
            meta=meta,
            max_tokens=max(spans.kept, default=0),
            planes=lay.kv_size * lay.num_layers if whole else lay.kv_size,
            layer=layer,
            num_layers=lay.num_layers,
            k_stride=k_stride,
            block_size=block,
            kv_size=lay.kv_size,
            token_stride=self.row_bytes if whole else self.row_bytes * lay.kv_size,
        )

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
        lay = self.paged.layout
        self._check(tensors, spans, lay.chunk_shape)
        k_size, layers, n = lay.kv_size, lay.num_layers, spans.num_tokens
        if n == 0:
            return
        rb = self.row_bytes
        slots = self.slots(slot_mapping, spans)
        first_row = [t.data_ptr() + k * rb for t, k in zip(tensors, spans.skips, strict=True)]
        if self.fused:
            meta = self._meta(spans, [first_row], [length * rb for length in spans.lengths])[0]
            rows = self._paged_rows(slots, meta, spans, None)
            copy_paged_rows(rows, rb, self._word(tensors), to_cache=to_cache)
            return
        # Address tensors: slot-mapping position, object address of the token's
        # (k=0, layer 0) row, and the distance between its object's (k, layer) planes.
        meta = torch.stack(
            (
                spans.ramp(spans.first, 1),
                spans.ramp(first_row, rb),
                spans.ramp([length * rb for length in spans.lengths], 0),
            )
        )
        meta = self._upload.send(meta)
        cache_rows = lay.rows(slots[meta[0]])  # [K, N]
        cache = self._layer_addr.view(1, layers, 1) + (cache_rows * rb).view(k_size, 1, n)
        objs = self._planes.view(k_size, layers, 1) * meta[2] + meta[1]
        self._copy(cache.reshape(-1), objs.reshape(-1), tensors, to_cache)

    # -- one layer at a time: [T, K, W] (MLA [T, W]) --------------------------------------

    def layers(self, slot_mapping: torch.Tensor, spans: TokenSpans) -> LayerCopies:
        """The per-layer copies of one layerwise batch."""
        return LayerCopies(self, self.slots(slot_mapping, spans), spans)


class LayerCopies:
    """One layerwise batch: :meth:`prepare` (optional) sends every layer's object table
    at once; :meth:`copy` moves one layer's rows in one launch."""

    def __init__(self, copier: DirectCopier, slots: torch.Tensor, spans: TokenSpans) -> None:
        self.copier, self.slots, self.spans = copier, slots, spans
        self._tables: torch.Tensor | None = None  # fused: [L, 4, C]; else [L, N * K] addresses
        self._cache_addr: torch.Tensor | None = None  # address path: [L, N * K]

    def _tables_for(self, tensors: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        copier, spans = self.copier, self.spans
        lay = copier.paged.layout
        k_size, rb = lay.kv_size, copier.row_bytes
        for group in tensors:
            copier._check(group, spans, lay.layer_chunk_shape)
        first_row = [
            [t.data_ptr() + k * k_size * rb for t, k in zip(group, spans.skips, strict=True)]
            for group in tensors
        ]
        if copier.fused:
            return copier._meta(spans, first_row, [rb] * len(spans.lengths))
        token = spans.ramp(first_row, k_size * rb)  # [G, N]: the token's k=0 row
        rows = token.unsqueeze(-1) + torch.arange(k_size, dtype=torch.int64) * rb
        return copier._upload.send(rows.view(len(tensors), -1))

    def prepare(self, tensors: Sequence[Sequence[torch.Tensor]]) -> None:
        """Every layer's objects known up front (stores): one upload for all of them."""
        self._tables = self._tables_for(tensors)

    def copy(self, layer: int, tensors: Sequence[torch.Tensor], *, to_cache: bool) -> None:
        copier, spans = self.copier, self.spans
        if spans.num_tokens == 0:
            return
        table = self._tables[layer] if self._tables is not None else self._tables_for([tensors])[0]
        word = copier._word(tensors)
        if copier.fused:
            rows = copier._paged_rows(self.slots, table, spans, layer)
            copy_paged_rows(rows, copier.row_bytes, word, to_cache=to_cache)
            return
        if self._cache_addr is None:
            positions = copier._upload.send(spans.ramp(spans.first, 1))
            rows_tm = copier.paged.layout.rows(self.slots[positions], token_major=True)
            self._cache_addr = copier._layer_addr.view(-1, 1) + (rows_tm * copier.row_bytes).view(1, -1)
        copier._copy(self._cache_addr[layer], table, tensors, to_cache)
