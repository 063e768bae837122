"""Gather and scatter between paged KV caches and contiguous chunk tensors.

Owns: the copy kernels themselves (``index_select`` / ``index_copy_`` on the row views
that :mod:`kvstore.gpu.layout` defines), for a whole chunk (``[K, L, T, W]``) or one layer
(``[T, K, W]``; MLA ``[T, W]``). Operations run on whatever stream is current and on
whatever device the caches live on; the chunk tensor must be on that same device.

Must not touch: streams, events, host staging, LMCache objects (see
:mod:`kvstore.gpu.connector` and :mod:`kvstore.gpu.staging`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.gpu.layout import KVLayout, PagedLayout, check_slot_mapping, discover_layout

__all__ = ["PagedKVCache"]


def _word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer type that tiles a row: the kernels then move 8-byte words
    instead of 2-byte elements (a pure byte copy, measurably faster on CPU)."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return dt
    return torch.uint8


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    try:
        return t.view(word)
    except RuntimeError:  # misaligned offset or strided last dimension
        return None


class PagedKVCache:
    """vLLM's per-layer paged KV tensors, addressed by slot.

    >>> cache = PagedKVCache(kv_caches)              # layout discovered from the shapes
    >>> chunk = cache.gather(slots)                  # [K, L, T, W] on the caches' device
    >>> fresh.scatter(slots, chunk)                  # back into (other) paged tensors
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout | str | None = None) -> None:
        self.layout: PagedLayout = discover_layout(kv_caches, layout)
        self.kv_caches = list(kv_caches)
        self._tables = [self.layout.row_view(t) for t in self.kv_caches]
        self._word = _word_dtype(self.layout.width * self.layout.dtype.itemsize)
        self._word_tables = [t.view(self._word) for t in self._tables]
        # [kv_size] row offset of each K/V plane, for token-major rows in one add. Made once,
        # here, from host values: the copy waits for the caller's stream, so the offsets are
        # on the device before any stream reads them.
        k_stride, _ = self.layout.row_terms()
        self._plane_offsets = torch.tensor(
            [k * k_stride for k in range(self.layout.kv_size)], dtype=torch.int64, device=self.device
        )

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def same_tensors(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        """True when ``kv_caches`` are exactly the tensors this object addresses."""
        return len(kv_caches) == len(self.kv_caches) and all(
            a is b for a, b in zip(kv_caches, self.kv_caches)
        )

    def slots(self, slot_mapping: torch.Tensor, *, validate: bool | None = None) -> torch.Tensor:
        """Checked int64 slots on the caches' device."""
        slots = check_slot_mapping(slot_mapping, self.layout.num_slots, validate=validate)
        if slots.device != self.device:
            slots = slots.to(self.device, non_blocking=True)
        return slots

    def _check_chunk(self, t: torch.Tensor, shape: torch.Size, what: str) -> None:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{what} is {t.dtype} but the KV cache is {self.dtype}")
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device} but the KV cache is on {self.device}")

    def _select(self, layer: int, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (rows of one token vector each) = this layer's rows at ``index``."""
        words = _as_words(out, self._word) if out.is_contiguous() else None
        if words is not None:
            table = self._word_tables[layer]
            torch.index_select(table, 0, index, out=words.view(-1, table.shape[1]))
        else:
            out.copy_(self._tables[layer].index_select(0, index).view(out.shape))

    def _copy(self, layer: int, index: torch.Tensor, src: torch.Tensor) -> None:
        """This layer's rows at ``index`` = ``src`` (rows of one token vector each)."""
        words = _as_words(src, self._word)
        if words is not None:
            table = self._word_tables[layer]
            table.index_copy_(0, index, words.reshape(-1, table.shape[1]))
        else:
            table = self._tables[layer]
            table.index_copy_(0, index, src.reshape(-1, table.shape[1]))

    # -- whole chunk: [K, L, T, W] -------------------------------------------------

    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the tokens at ``slots`` out of every layer into ``[K, L, T, W]``."""
        slots = self.slots(slots)
        shape = self.layout.chunk_shape(slots.numel())
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._check_chunk(out, shape, "chunk tensor")
        rows = self.layout.rows(slots)
        for layer in range(self.num_layers):
            for k in range(self.layout.kv_size):
                self._select(layer, rows[k], out[k, layer])
        return out

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``[K, L, T, W]`` into every layer at ``slots``."""
        slots = self.slots(slots)
        self._check_chunk(src, self.layout.chunk_shape(slots.numel()), "chunk tensor")
        rows = self.layout.rows(slots)
        for layer in range(self.num_layers):
            for k in range(self.layout.kv_size):
                self._copy(layer, rows[k], src[k, layer])

    # -- one layer: [T, K, W] (MLA [T, W]) ------------------------------------------

    def layer_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Token-major row indices for :meth:`gather_layer` / :meth:`scatter_layer`: a new
        tensor (never a view of ``slots``, which vLLM refills for its next step). One
        broadcast add on FlashAttention / MLA slots (three kernels on FlashInfer's): a
        request makes them before its first gather, each launch ~10-40 us of host time."""
        return self.layout.rows(self.slots(slots), token_major=True, plane_offsets=self._plane_offsets)

    def gather_layer(self, layer: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy one layer's tokens (``rows`` from :meth:`layer_rows`) into ``[T, K, W]``."""
        num_tokens = rows.numel() // self.layout.kv_size
        self._check_chunk(out, self.layout.layer_chunk_shape(num_tokens), f"layer {layer} tensor")
        self._select(layer, rows, out)
        return out

    def scatter_layer(self, layer: int, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Write one layer's ``[T, K, W]`` tensor into the cache at ``rows``."""
        num_tokens = rows.numel() // self.layout.kv_size
        self._check_chunk(src, self.layout.layer_chunk_shape(num_tokens), f"layer {layer} tensor")
        self._copy(layer, rows, src)

    # -- one layer, checked once: for a pipeline issuing one call per layer ------------

    def layer_words(self, t: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``t``, a contiguous ``[T, K, W]`` (MLA ``[T, W]``) layer tensor of ``num_tokens``
        tokens, as the word rows :meth:`gather_words` / :meth:`scatter_words` move: the
        checks of :meth:`gather_layer` made once, for a buffer used for every layer."""
        self._check_chunk(t, self.layout.layer_chunk_shape(num_tokens), "layer buffer")
        words = _as_words(t, self._word) if t.is_contiguous() else None
        if words is None:
            raise ValueError("a layer buffer must be contiguous and aligned to the cache's word size")
        return words.view(-1, self._word_tables[0].shape[1])

    def gather_words(self, layer: int, rows: torch.Tensor, words: torch.Tensor) -> None:
        """:meth:`gather_layer` into ``words`` from :meth:`layer_words`."""
        torch.index_select(self._word_tables[layer], 0, rows, out=words)

    def scatter_words(self, layer: int, rows: torch.Tensor, words: torch.Tensor) -> None:
        """:meth:`scatter_layer` from ``words`` from :meth:`layer_words`."""
        self._word_tables[layer].index_copy_(0, rows, words)

    @property
    def is_mla(self) -> bool:
        return self.layout.kind is KVLayout.MLA
