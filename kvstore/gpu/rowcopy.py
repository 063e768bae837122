"""Move every row of a paged KV transfer in one launch.

Owns: the copy behind the connectors' direct path. Each row (one token's K, V or latent
vector of one layer) moves between the paged cache and a memory object; the kernel finds
both addresses itself from the slot mapping, the layers' base addresses and a small
per-chunk table (:class:`PagedRows`). On CUDA it is one Triton kernel, whose object side
may be device memory or pinned host memory, which the GPU reaches through unified
virtual addressing, so a paged-cache gather and the PCIe transfer to LMCache's pinned
pool are the same single pass (no device scratch, no separate DMA, one launch for every
layer and chunk). On the CPU the same arithmetic runs as a host loop (``ctypes.memmove``
per row), and under Triton's interpreter the kernel itself runs on host tensors, so both
are tested without a GPU.

Must not touch: which tensors are eligible and how the table is built
(kvstore.gpu.direct), which stream runs the copy (kvstore.gpu.transfer). The row of a
``(k, slot)`` pair is :func:`kvstore.gpu.layout.row_index`; the kernel repeats that
formula because Triton code cannot call it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.gpu.layout import row_index

__all__ = ["PagedRows", "copy_paged_rows", "kernel_available", "uses_kernel", "word_bytes"]

_MAX_BLOCK_WORDS = 1024


def word_bytes(row_bytes: int, addresses: list[int]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides ``row_bytes`` and every base
    address, so rows are moved as whole aligned words."""
    g = math.gcd(row_bytes, *addresses) if addresses else row_bytes
    for size in (8, 4, 2):
        if g % size == 0:
            return size
    return 1


@functools.cache
def _paged_kernel() -> Any:
    """The fused kernel: finds each row's two addresses itself (see copy_paged_rows)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def paged_rows_kernel(
        slot_mapping,
        layer_addr,
        meta,
        num_chunks,
        layer,
        num_layers,
        k_stride,
        block_size,
        kv_size,
        token_stride,
        row_bytes,
        TO_CACHE: tl.constexpr,
        WHOLE: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        ROW_WORDS: tl.constexpr,
        BLOCK: tl.constexpr,
        WORD: tl.constexpr,
    ):
        t = tl.program_id(0)  # token within its chunk's moved tokens
        c = tl.program_id(1)  # chunk
        plane = tl.program_id(2)  # whole chunks: k * num_layers + layer; one layer: k
        live = t < tl.load(meta + 3 * num_chunks + c)
        slot = tl.load(slot_mapping + tl.load(meta + c) + t, mask=live, other=0)
        if WHOLE:
            k = plane // num_layers
            lay = plane % num_layers
        else:
            k = plane
            lay = layer
        if INTERLEAVED:
            row = (slot // block_size) * (block_size * kv_size) + slot % block_size + k * k_stride
        else:
            row = slot + k * k_stride
        cache_at = tl.load(layer_addr + lay) + row * row_bytes
        obj_at = tl.load(meta + num_chunks + c) + t.to(tl.int64) * token_stride
        obj_at += plane.to(tl.int64) * tl.load(meta + 2 * num_chunks + c)
        if WORD == 8:
            ty = tl.int64
        elif WORD == 4:
            ty = tl.int32
        elif WORD == 2:
            ty = tl.int16
        else:
            ty = tl.int8
        if TO_CACHE:
            src = obj_at.to(tl.pointer_type(ty))
            dst = cache_at.to(tl.pointer_type(ty))
        else:
            src = cache_at.to(tl.pointer_type(ty))
            dst = obj_at.to(tl.pointer_type(ty))
        for off in tl.static_range(0, ROW_WORDS, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            mask = (idx < ROW_WORDS) & live
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return paged_rows_kernel


def kernel_available() -> bool:
    """True when the CUDA row-copy kernel can be built (Triton is importable)."""
    return _paged_kernel() is not None


def uses_kernel(device: torch.device) -> bool:
    """Whether :func:`copy_paged_rows` runs the Triton kernel for tensors on ``device``:
    always on CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1``),
    else the host loop."""
    return device.type == "cuda" or (os.environ.get("TRITON_INTERPRET", "") == "1" and kernel_available())


@dataclass(frozen=True)
class PagedRows:
    """Where the rows of one paged transfer live, for :func:`copy_paged_rows`.

    Row ``(k, slot)`` of a layer: ``k * k_stride + slot`` or, when ``block_size`` is set
    (blocks holding K then V), ``(slot // block_size) * block_size * kv_size +
    slot % block_size + k * k_stride`` (kvstore.gpu.layout's ``row_terms``). ``meta`` is
    ``[4, C]`` int64 on the device, per chunk: position in ``slot_mapping`` of its first
    moved token, object address of that token's first row, bytes between the object's
    planes, moved token count. Token ``t`` of chunk ``c``, plane ``p`` lives in the object
    at ``meta[1, c] + t * token_stride + p * meta[2, c]``.
    """

    slot_mapping: torch.Tensor  # int64, on the device
    layer_addr: torch.Tensor  # int64 [L], each layer's base address
    meta: torch.Tensor
    max_tokens: int  # the most tokens any chunk moves
    planes: int  # whole chunks: K * L; one layer: K
    layer: int | None  # None: whole chunks (plane p is k = p // L, layer p % L)
    num_layers: int
    k_stride: int
    block_size: int  # 0: rows are k * k_stride + slot
    kv_size: int
    token_stride: int


def copy_paged_rows(
    rows: PagedRows, row_bytes: int, word: int, *, to_cache: bool, num_warps: int = 4
) -> None:
    """Move every row of a paged transfer: one Triton launch that computes both addresses
    of each row itself (see :func:`uses_kernel`), or the host loop on the CPU."""
    if not uses_kernel(rows.meta.device):
        _host_loop(rows, row_bytes, to_cache)
        return
    kernel = _paged_kernel()
    if kernel is None:
        raise RuntimeError(
            "the CUDA row copy needs Triton: pip install triton (PyTorch's CUDA wheels ship it)"
        )
    chunks = rows.meta.shape[1]
    if rows.max_tokens == 0 or chunks == 0 or rows.planes == 0:
        return
    words = row_bytes // word
    block = min(_MAX_BLOCK_WORDS, 1 << max(0, (words - 1).bit_length()))
    kernel[(rows.max_tokens, chunks, rows.planes)](
        rows.slot_mapping,
        rows.layer_addr,
        rows.meta,
        chunks,
        0 if rows.layer is None else rows.layer,
        rows.num_layers,
        rows.k_stride,
        max(rows.block_size, 1),
        rows.kv_size,
        rows.token_stride,
        row_bytes,
        TO_CACHE=to_cache,
        WHOLE=rows.layer is None,
        INTERLEAVED=rows.block_size > 0,
        ROW_WORDS=words,
        BLOCK=block,
        WORD=word,
        num_warps=num_warps,
    )


def _host_loop(rows: PagedRows, row_bytes: int, to_cache: bool) -> None:
    """The kernel's arithmetic, row by row on the host (CPU tensors: tests and CI)."""
    first, base, plane_bytes, kept = rows.meta.tolist()
    slots, layer_addr = rows.slot_mapping.tolist(), rows.layer_addr.tolist()
    for c in range(len(kept)):
        for t in range(kept[c]):
            slot = slots[first[c] + t]
            for plane in range(rows.planes):
                k, lay = divmod(plane, rows.num_layers) if rows.layer is None else (plane, rows.layer)
                cache_at = (
                    layer_addr[lay]
                    + row_index(slot, k, rows.k_stride, rows.block_size, rows.kv_size) * row_bytes
                )
                obj_at = base[c] + t * rows.token_stride + plane * plane_bytes[c]
                src, dst = (obj_at, cache_at) if to_cache else (cache_at, obj_at)
                ctypes.memmove(dst, src, row_bytes)
