"""A CPU "GPU connector" for contiguous per-layer KV caches (HF transformers' layout).

LMCache moves KV between an inference engine and its MemoryObjs through a
``GPUConnectorInterface``.  vLLM's connectors expect a paged cache; LMCache's
``MockGPUConnector`` copies nothing.  This one gathers/scatters between a contiguous
cache — one ``(K, V)`` pair per layer, each ``[1, heads, tokens, head_dim]`` as in a
transformers ``DynamicCache`` — and LMCache's ``KV_2LTD`` objects
(``[2, layers, tokens, heads * head_dim]``).

Owns: those copies and nothing else.  Must not touch: storage, the model.  Pass the
cache as ``kvcaches=[(K0, V0), (K1, V1), ...]`` to ``engine.store`` and
``engine.retrieve`` (for retrieve, preallocated tensors long enough for the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lmcache.v1.memory_management import MemoryObj

from kvstore.lmcache_paths import INPROCESS

if INPROCESS == "lmcache.v1":  # LMCache 0.5.6 and earlier
    from lmcache.v1.gpu_connector import GPUConnectorInterface
else:
    from lmcache.inprocess.v1.gpu_connector import GPUConnectorInterface

KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class ContiguousKVConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def _views(self, memory_obj: MemoryObj, start: int, end: int) -> torch.Tensor:
        t = memory_obj.tensor
        if t is None:
            raise ValueError("MemoryObj was invalidated")
        n = end - start
        if t.dim() != 4 or t.shape[0] != 2 or t.shape[1] != self.num_layers or t.shape[2] < n:
            raise ValueError(f"MemoryObj of shape {tuple(t.shape)} cannot hold KV_2LTD for {n} tokens")
        return t[:, :, :n].view(2, self.num_layers, n, self.num_kv_heads, self.head_dim)

    @staticmethod
    def _pairs(kwargs: dict) -> KVPairs:
        kv = kwargs.get("kvcaches")
        if kv is None:
            raise ValueError("pass kvcaches=[(K, V), ...] (one pair per layer) to store/retrieve")
        return kv

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        dst = self._views(memory_obj, start, end)
        for layer, (k, v) in enumerate(self._pairs(kwargs)):
            # [1, H, T, D] -> tokens first: [n, H, D]
            dst[0, layer].copy_(k[0, :, start:end, :].transpose(0, 1))
            dst[1, layer].copy_(v[0, :, start:end, :].transpose(0, 1))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        src = self._views(memory_obj, start, end)
        for layer, (k, v) in enumerate(self._pairs(kwargs)):
            k[0, :, start:end, :].copy_(src[0, layer].transpose(0, 1))
            v[0, :, start:end, :].copy_(src[1, layer].transpose(0, 1))

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, s, e in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, s, e, **kwargs)


def empty_kv(num_layers: int, num_kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> list:
    """Preallocated ``[(K, V)] * layers`` to retrieve into."""
    return [
        (
            torch.zeros(1, num_kv_heads, tokens, head_dim, dtype=dtype),
            torch.zeros(1, num_kv_heads, tokens, head_dim, dtype=dtype),
        )
        for _ in range(num_layers)
    ]
