"""Copy many rows between arbitrary addresses in one launch.

Owns: the one-launch row copy behind the connectors' direct path: ``n`` rows of
``row_bytes`` each, row ``i`` read at byte address ``src[i]`` and written at
``dst[i]``. On CUDA it is one Triton kernel; its addresses may be device memory or
pinned host memory, which the GPU reaches through unified virtual addressing, so a
paged-cache gather and the PCIe transfer to LMCache's pinned pool are the same single
pass (no device scratch, no separate DMA, one launch for every layer and chunk). On
CPU the same operation runs as a host loop (``ctypes.memmove`` per row), so the
address arithmetic that feeds it is tested without a GPU.

Must not touch: where a token's rows live (kvstore.gpu.layout / paged), which tensors
are eligible or which stream runs the copy (kvstore.gpu.direct / transfer).
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PagedRows", "copy_paged_rows", "copy_rows", "kernel_available", "word_bytes"]

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
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; ``None`` when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_rows_kernel(
        src_addr, dst_addr, ROW_WORDS: tl.constexpr, BLOCK: tl.constexpr, WORD: tl.constexpr
    ):
        row = tl.program_id(0)
        if WORD == 8:
            ty = tl.int64
        elif WORD == 4:
            ty = tl.int32
        elif WORD == 2:
            ty = tl.int16
        else:
            ty = tl.int8
        src = tl.load(src_addr + row).to(tl.pointer_type(ty))
        dst = tl.load(dst_addr + row).to(tl.pointer_type(ty))
        for off in tl.static_range(0, ROW_WORDS, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < ROW_WORDS
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy_rows_kernel


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
    return _kernel() is not None


def copy_rows(src: torch.Tensor, dst: torch.Tensor, row_bytes: int, word: int, *, num_warps: int = 4) -> None:
    """Copy row ``i`` (``row_bytes`` bytes) from address ``src[i]`` to ``dst[i]``.

    ``src`` / ``dst``: 1-D int64 address tensors of equal length, on the CUDA device
    that runs the copy (on the current stream), or on the CPU for the host loop.
    ``word`` divides ``row_bytes`` and every address (see :func:`word_bytes`). Rows
    must not overlap each other.
    """
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(
            f"address tensors must be 1-D and alike, got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if row_bytes % word:
        raise ValueError(f"row of {row_bytes} bytes is not a whole number of {word}-byte words")
    n = src.numel()
    if n == 0:
        return
    if src.device.type == "cpu":
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            ctypes.memmove(d, s, row_bytes)
        return
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError(
            "the CUDA row copy needs Triton: pip install triton (PyTorch's CUDA wheels ship it)"
        )
    words = row_bytes // word
    block = min(_MAX_BLOCK_WORDS, 1 << max(0, (words - 1).bit_length()))
    kernel[(n,)](src, dst, ROW_WORDS=words, BLOCK=block, WORD=word, num_warps=num_warps)


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
    """One launch that moves every row of a paged transfer, computing both addresses of
    each row on the device (no per-row address tensors, so almost no host work)."""
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
