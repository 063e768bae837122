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


def _select_into(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = table[index[i]]`` for an ``out`` viewed as rows of the table's width."""
    if out.is_contiguous():
        torch.index_select(table, 0, index, out=out.view(-1, table.shape[1]))
    else:
        out.copy_(table.index_select(0, index).view(out.shape))


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

    # -- whole chunk: [K, L, T, W] -------------------------------------------------

    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the tokens at ``slots`` out of every layer into ``[K, L, T, W]``."""
        slots = self.slots(slots)
        shape = self.layout.chunk_shape(slots.numel())
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._check_chunk(out, shape, "chunk tensor")
        rows = self.layout.rows(slots)
        for layer, table in enumerate(self._tables):
            for k in range(self.layout.kv_size):
                _select_into(table, rows[k], out[k, layer])
        return out

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``[K, L, T, W]`` into every layer at ``slots``."""
        slots = self.slots(slots)
        self._check_chunk(src, self.layout.chunk_shape(slots.numel()), "chunk tensor")
        rows = self.layout.rows(slots)
        for layer, table in enumerate(self._tables):
            for k in range(self.layout.kv_size):
                table.index_copy_(0, rows[k], src[k, layer])

    # -- one layer: [T, K, W] (MLA [T, W]) ------------------------------------------

    def layer_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Token-major row indices for :meth:`gather_layer` / :meth:`scatter_layer`."""
        return self.layout.rows(self.slots(slots), token_major=True)

    def gather_layer(self, layer: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy one layer's tokens (``rows`` from :meth:`layer_rows`) into ``[T, K, W]``."""
        num_tokens = rows.numel() // self.layout.kv_size
        self._check_chunk(out, self.layout.layer_chunk_shape(num_tokens), f"layer {layer} tensor")
        _select_into(self._tables[layer], rows, out)
        return out

    def scatter_layer(self, layer: int, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Write one layer's ``[T, K, W]`` tensor into the cache at ``rows``."""
        num_tokens = rows.numel() // self.layout.kv_size
        self._check_chunk(src, self.layout.layer_chunk_shape(num_tokens), f"layer {layer} tensor")
        table = self._tables[layer]
        table.index_copy_(0, rows, src.reshape(-1, table.shape[1]))

    @property
    def is_mla(self) -> bool:
        return self.layout.kind is KVLayout.MLA
