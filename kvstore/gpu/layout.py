"""Paged KV-cache layouts and the index arithmetic that addresses them.

Owns: recognising vLLM's per-layer paged KV tensors (FlashAttention, FlashInfer, MLA),
viewing one layer as a 2-D table of rows (one row = one token's K, V or latent vector),
and turning a ``slot_mapping`` (token -> ``block_id * block_size + offset``) into row
indices. Every other module in ``kvstore.gpu`` asks this one where a token lives; no
stride or block arithmetic happens anywhere else.

Must not touch: streams, host buffers, LMCache objects. Pure shape logic plus cheap
torch index ops, so it runs the same on CPU and CUDA.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "KVLayout",
    "LayoutError",
    "PagedLayout",
    "SlotMappingError",
    "check_slot_mapping",
    "discover_layout",
    "row_index",
]


class LayoutError(ValueError):
    """The KV cache tensors are not in a layout this package can address."""


class SlotMappingError(ValueError):
    """A slot mapping is malformed or points outside the paged pool."""


class KVLayout(str, enum.Enum):
    """Per-layer paged KV-cache layouts, named as vLLM's attention backends are."""

    FLASH_ATTN = "flash_attn"  # [2, num_blocks, block_size, num_kv_heads, head_size]
    FLASH_INFER = "flash_infer"  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    MLA = "mla"  # [num_blocks, block_size, head_dim]

    @classmethod
    def parse(cls, value: KVLayout | str) -> KVLayout:
        if isinstance(value, KVLayout):
            return value
        normalized = str(value).strip().lower().replace("-", "_")
        aliases = {"flash_attention": "flash_attn", "fa": "flash_attn", "flashinfer": "flash_infer"}
        normalized = aliases.get(normalized, normalized)
        try:
            return cls(normalized)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise LayoutError(f"unknown KV layout {value!r}; use one of {names}") from None


_SUPPORTED = (
    "FlashAttention [2, num_blocks, block_size, num_kv_heads, head_size], "
    "FlashInfer [num_blocks, 2, block_size, num_kv_heads, head_size] or "
    "MLA [num_blocks, block_size, head_dim]"
)


@dataclass(frozen=True)
class PagedLayout:
    """Geometry of a list of per-layer paged KV tensors (all layers alike)."""

    kind: KVLayout
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # 1 for MLA
    head_size: int  # head_dim for MLA
    dtype: torch.dtype
    device: torch.device

    @property
    def kv_size(self) -> int:
        """2 (separate K and V) or 1 (MLA's single latent vector)."""
        return 1 if self.kind is KVLayout.MLA else 2

    @property
    def width(self) -> int:
        """Elements in one token's K (or V, or latent) vector: ``H*D`` (MLA: ``D``)."""
        return self.num_kv_heads * self.head_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def layer_shape(self) -> tuple[int, ...]:
        if self.kind is KVLayout.FLASH_ATTN:
            return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        if self.kind is KVLayout.FLASH_INFER:
            return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_size)
        return (self.num_blocks, self.block_size, self.head_size)

    # -- chunk tensor shapes (LMCache MemoryFormat) --------------------------------

    def chunk_shape(self, num_tokens: int) -> torch.Size:
        """Whole-chunk tensor: ``KV_2LTD`` ``[2, L, T, H*D]``; MLA ``KV_MLA_FMT`` ``[1, L, T, D]``."""
        return torch.Size([self.kv_size, self.num_layers, num_tokens, self.width])

    def layer_chunk_shape(self, num_tokens: int) -> torch.Size:
        """One layer's tensor: ``KV_T2D`` ``[T, 2, H*D]``; MLA ``[T, D]``."""
        if self.kind is KVLayout.MLA:
            return torch.Size([num_tokens, self.width])
        return torch.Size([num_tokens, 2, self.width])

    # -- index arithmetic ----------------------------------------------------------

    def row_view(self, cache: torch.Tensor) -> torch.Tensor:
        """View one layer's cache as ``[kv_size * num_slots, width]`` rows (no copy)."""
        if tuple(cache.shape) != self.layer_shape:
            raise LayoutError(
                f"layer tensor has shape {tuple(cache.shape)}, expected {self.layer_shape} ({self.kind.value})"
            )
        if not cache.is_contiguous():
            raise LayoutError(
                f"layer tensor of shape {tuple(cache.shape)} has strides {cache.stride()}: "
                "only contiguous (NHD) paged caches are supported; pass the physical tensor, "
                "not a permuted view (HND layouts are not supported)"
            )
        return cache.view(self.kv_size * self.num_slots, self.width)

    def row_terms(self) -> tuple[int, int]:
        """``(k_stride, block)``: row of ``(k, slot)`` is ``k * k_stride + slot`` when
        ``block`` is 0, else ``(slot // block) * block * kv_size + slot % block + k * k_stride``.

        FlashAttention keeps a K plane then a V plane ``num_slots`` rows later; FlashInfer
        interleaves per block (its K rows, then its V rows); MLA has one row per slot.
        """
        if self.kind is KVLayout.MLA:
            return 0, 0
        if self.kind is KVLayout.FLASH_ATTN:
            return self.num_slots, 0
        return self.block_size, self.block_size

    def rows(
        self, slots: torch.Tensor, *, token_major: bool = False, plane_offsets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Row indices (into :meth:`row_view`) of the tokens at ``slots``.

        ``token_major=False`` gives ``[kv_size, T]`` (K rows then V rows: the order of a
        ``KV_2LTD`` layer slice); ``token_major=True`` gives ``[T * kv_size]`` interleaved
        ``k0, v0, k1, v1, ...`` (the order of a ``KV_T2D`` layer tensor's rows).
        ``plane_offsets``: ``arange(kv_size) * k_stride`` on the slots' device (a caller
        that keeps it saves a launch per call); token-major rows are then one broadcast add.
        """
        slots = slots.to(torch.int64)
        k_stride, block = self.row_terms()
        # row_index in few kernels (this runs once per request, before its first copy):
        # (slot // block) * block * kv_size + slot % block == slot + (slot // block) * block * (kv_size - 1)
        base = slots.add(slots // block, alpha=block * (self.kv_size - 1)) if block else slots
        if token_major and plane_offsets is not None:
            return (base.unsqueeze(1) + plane_offsets).view(-1)
        planes = [base] + [base + k * k_stride for k in range(1, self.kv_size)]
        if token_major:
            return torch.stack(planes, dim=1).view(-1)
        return torch.stack(planes)


def row_index(slot, k: int, k_stride: int, block: int, kv_size: int):
    """Row (into :meth:`PagedLayout.row_view`) of ``(k, slot)`` from ``row_terms()``; works
    on ints and on int64 tensors of slots alike."""
    if block:
        return (slot // block) * (block * kv_size) + slot % block + k * k_stride
    return slot + k * k_stride


def discover_layout(kv_caches: Sequence[torch.Tensor], layout: KVLayout | str | None = None) -> PagedLayout:
    """Recognise the layout of vLLM's per-layer KV tensors.

    ``layout`` is a hint; it is required only when the shape is ambiguous (a 5-D cache
    with ``num_blocks == 2`` fits both FlashAttention and FlashInfer) and is checked
    against the shape otherwise.
    """
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise LayoutError(
            "kv_caches must be a list of per-layer tensors (one per attention layer), "
            f"got {type(kv_caches).__name__}"
        )
    if len(kv_caches) == 0:
        raise LayoutError("kv_caches is empty: pass one paged tensor per attention layer")
    first = kv_caches[0]
    if not isinstance(first, torch.Tensor):
        raise LayoutError(
            f"kv_caches[0] is a {type(first).__name__}; each layer must be one tensor in {_SUPPORTED}"
        )
    for i, t in enumerate(kv_caches):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"kv_caches[{i}] is a {type(t).__name__}, not a tensor")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(
                f"kv_caches[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} but layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all layers must match"
            )
    hint = KVLayout.parse(layout) if layout is not None else None
    shape = tuple(first.shape)

    if len(shape) == 3:
        kind = KVLayout.MLA
    elif len(shape) == 5:
        fa, fi = shape[0] == 2, shape[1] == 2
        if hint is not None and hint is not KVLayout.MLA:
            kind = hint
        elif fa and fi:
            raise LayoutError(
                f"KV cache shape {shape} is ambiguous (num_blocks == 2 fits both FlashAttention "
                "and FlashInfer): pass layout='flash_attn' or layout='flash_infer'"
            )
        elif fa or fi:
            kind = KVLayout.FLASH_ATTN if fa else KVLayout.FLASH_INFER
        else:
            raise LayoutError(f"KV cache shape {shape} is not a supported layout; expected {_SUPPORTED}")
    else:
        raise LayoutError(f"KV cache shape {shape} ({len(shape)}-D) is not supported; expected {_SUPPORTED}")

    kv_dim = {KVLayout.FLASH_ATTN: 0, KVLayout.FLASH_INFER: 1}.get(kind)
    if (hint is not None and hint is not kind) or (kv_dim is not None and shape[kv_dim] != 2):
        named = f"layout hint {hint.value!r}" if hint is not None else f"layout {kind.value!r}"
        raise LayoutError(f"{named} does not match KV cache shape {shape}; expected {_SUPPORTED}")
    dims: tuple[int, ...] = shape
    if kind is KVLayout.FLASH_ATTN:
        nb, bs, h, d = dims[1], dims[2], dims[3], dims[4]
    elif kind is KVLayout.FLASH_INFER:
        nb, bs, h, d = dims[0], dims[2], dims[3], dims[4]
    else:
        nb, bs, h, d = dims[0], dims[1], 1, dims[2]
    result = PagedLayout(kind, len(kv_caches), nb, bs, h, d, first.dtype, first.device)
    for t in kv_caches:
        result.row_view(t)  # contiguity check with a clear message
    return result


def check_slot_mapping(slots: torch.Tensor, num_slots: int, *, validate: bool | None = None) -> torch.Tensor:
    """Check a slot mapping slice and return it as int64.

    ``validate=None`` range-checks host tensors only (reading a CUDA tensor's min/max
    would stall the stream); an out-of-range slot on CUDA still fails loudly in the
    index kernel rather than writing elsewhere.
    """
    if not isinstance(slots, torch.Tensor):
        slots = torch.as_tensor(slots, dtype=torch.int64)
    if slots.dim() != 1:
        raise SlotMappingError(
            f"slot_mapping must be 1-D (one slot per token), got shape {tuple(slots.shape)}"
        )
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise SlotMappingError(f"slot_mapping must hold integers, got {slots.dtype}")
    if validate is None:
        validate = slots.device.type == "cpu"
    if validate and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0:
            raise SlotMappingError(
                f"slot_mapping contains {lo}: negative slots mark tokens vLLM did not place "
                "(prefix-cache hits); pass start/end that exclude them"
            )
        if hi >= num_slots:
            raise SlotMappingError(f"slot_mapping contains {hi} but the paged pool has {num_slots} slots")
    return slots.to(torch.int64)
