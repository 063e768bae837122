"""Copies between vLLM's paged KV cache and contiguous chunk tensors.

Modules, each with one job:

- ``layout``    recognise the paged layout; all slot -> row index arithmetic.
- ``paged``     ``PagedKVCache``: gather/scatter whole chunks or single layers.
- ``staging``   reusable pinned host buffers and device scratch.
- ``transfer``  the copy stream, events and device<->host copies.
- ``connector`` LMCache ``GPUConnectorInterface`` adapters (imports lmcache; loaded
                lazily so the rest works without it).

Everything runs on CPU tensors with the same semantics as on CUDA.
"""

from __future__ import annotations

from typing import Any

from kvstore.gpu.layout import KVLayout, LayoutError, PagedLayout, SlotMappingError, discover_layout
from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.staging import DeviceScratch, PinnedPool

__all__ = [
    "DeviceScratch",
    "KVLayout",
    "LayerwisePagedKVConnector",
    "LayoutError",
    "PagedKVCache",
    "PagedKVConnector",
    "PagedLayout",
    "PinnedPool",
    "SlotMappingError",
    "discover_layout",
    "make_connector",
]

_LAZY = {"PagedKVConnector", "LayerwisePagedKVConnector", "make_connector"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvstore.gpu import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvstore.gpu' has no attribute {name!r}")
