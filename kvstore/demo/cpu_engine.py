"""Build a real LMCache engine on CPU for a contiguous-KV model, configured by ``LMCACHE_*``.

Owns: reading ``LMCacheEngineConfig.from_env()``, the engine metadata for a model's
KV geometry, `LMCacheEngineBuilder`, and a minimal in-process answer channel for
LMCache's async loading (``post_init(async_lookup_server=...)``), which vLLM's
scheduler would otherwise provide.  Must not touch: storage, the model.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.demo.hf_connector import ContiguousKVConnector
from kvstore.lmcache_paths import inprocess_module


class LookupAnswers:
    """Stands in for LMCache's async lookup server: collects prefetch results by id."""

    def __init__(self) -> None:
        self._done: dict[str, int] = {}
        self._cond = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        with self._cond:
            self._done[lookup_id] = int(retrieved_length)
            self._cond.notify_all()

    def wait(self, lookup_id: str, timeout: float) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: lookup_id in self._done, timeout=timeout)
            return self._done.pop(lookup_id, None)


@dataclass
class CPUEngine:
    engine: Any
    config: Any
    instance_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    answers: LookupAnswers = field(default_factory=LookupAnswers)

    @property
    def async_loading(self) -> bool:
        return bool(self.config.enable_async_loading)

    def lookup_then_load(
        self, tokens: torch.Tensor, kvcaches: Any, req_id: str | None = None
    ) -> tuple[int, int]:
        """LMCache's lookup and retrieve, sync or async-loading as configured.

        Returns (tokens the lookup reported, tokens retrieved into ``kvcaches``).
        """
        req_id = req_id or uuid.uuid4().hex
        if self.async_loading:
            self.engine.async_lookup_and_prefetch(lookup_id=req_id, tokens=tokens)
            hit = self.answers.wait(req_id, timeout=float(self.config.blocking_timeout_secs) + 5)
            if hit is None:
                raise TimeoutError("LMCache's async lookup never answered")
            if hit == 0:
                return 0, 0
            mask = self.engine.retrieve(tokens, kvcaches=kvcaches, req_id=req_id)
        else:
            hit = self.engine.lookup(tokens)
            if hit == 0:
                return 0, 0
            mask = self.engine.retrieve(tokens, kvcaches=kvcaches, req_id=req_id)
        return hit, int(mask.sum())

    def wait_for_writes(self, timeout: float = 30.0) -> bool:
        """Block until stores handed to LMCache's backends and to kvstore have ended."""
        deadline = time.monotonic() + timeout
        for backend in self.storage_backends().values():
            # LMCache's remote backend and its local disk backend's worker track their writes
            for owner in (backend, getattr(backend, "disk_worker", None)):
                while getattr(owner, "put_tasks", None) and time.monotonic() < deadline:
                    time.sleep(0.002)
        # a remote connector's batched puts are queued on LMCache's loop: once a no-op
        # queued after them has run, each has handed its write to kvstore
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.engine.storage_manager.loop).result(timeout)
        kv = self.kvstore_backend()
        left = max(0.0, deadline - time.monotonic())
        return kv.wait_for_writes(left) if kv is not None else True

    def storage_backends(self) -> dict[str, Any]:
        return dict(self.engine.storage_manager.storage_backends)

    def kvstore_backend(self) -> Any:
        """The kvstore storage plugin, or the kvstore remote connector, in this engine."""
        for backend in self.storage_backends().values():
            if type(backend).__name__ == "KVStoreStoragePlugin":
                return backend
            conn = getattr(backend, "connection", None)
            if conn is not None:
                inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
                if type(inner).__name__ == "KVStoreRemoteConnector":
                    return inner
        return None

    def close(self) -> None:
        inprocess_module("cache_engine").LMCacheEngineBuilder.destroy(self.instance_id)


def build_cpu_engine(
    *,
    model_name: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    instance_id: str | None = None,
) -> CPUEngine:
    """An LMCache engine whose configuration comes only from ``LMCACHE_*`` variables."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_env()
    config.validate()
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(num_layers, 2, config.chunk_size, num_kv_heads, head_dim),
        chunk_size=config.chunk_size,
    )
    connector = ContiguousKVConnector(num_layers, num_kv_heads, head_dim)
    instance_id = instance_id or f"kvstore-{uuid.uuid4().hex[:8]}"
    engine = inprocess_module("cache_engine").LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, connector, lambda t, i: None, lambda o, i: o
    )
    cpu = CPUEngine(engine, config, instance_id, num_layers, num_kv_heads, head_dim, dtype)
    engine.post_init(async_lookup_server=cpu.answers)
    return cpu
