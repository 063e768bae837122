"""kvstore as an LMCache remote connector (``RemoteConnector``).

Load it with::

    LMCACHE_REMOTE_STORAGE_PLUGINS=kvstore
    LMCACHE_REMOTE_SERDE=naive
    LMCACHE_EXTRA_CONFIG='{"remote_storage_plugin.kvstore.module_path": "kvstore_lmcache.remote_connector",
                           "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
                           "kvstore.tiers": ["file:///var/cache/kv", "redis://cache:6379"]}'

The plugin name must not be one LMCache's built-in adapters claim (``fs``, ``redis``,
``s3``, ``mock`` …: they win and this class is never loaded); ``kvstore`` is safe.
Keep ``remote_serde=naive``: compression belongs in kvstore's cold tier
(``kvstore.cold_codec=cachegen``), and LMCache's own cachegen serde fails in async mode.

Owns: translating connector calls into store calls.  Must not touch: reference
counts LMCache owns — ``put`` never calls ``ref_count_down`` for LMCache (its
instrumented wrapper does); the connector holds its own reference while a write runs.
Reads allocate from ``local_cpu_backend`` and return objects with ref count 1.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore_lmcache.bridge import InProcessBridge
from kvstore_lmcache.runtime import StoreRuntime, load_config, log


class KVStoreRemoteConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        if local_cpu_backend is None or getattr(local_cpu_backend, "metadata", None) is None:
            msg = (
                "the kvstore remote connector needs LMCache's CPU backend (allocator and metadata); "
                "set LMCACHE_MAX_LOCAL_CPU_SIZE > 0"
            )
            log.error("kvstore remote connector is NOT loaded: %s", msg)
            raise ValueError(msg)
        serde = getattr(config, "remote_serde", "naive")
        if serde not in (None, "naive"):
            msg = (
                f"LMCACHE_REMOTE_SERDE={serde!r}: use naive with kvstore; set kvstore.cold_codec=cachegen "
                "to compress in kvstore's cold tier instead"
            )
            log.error("kvstore remote connector is NOT loaded: %s", msg)
            raise ValueError(msg)
        # the dynamic connector path passes no metadata: LMCache's CPU backend has it
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.kv_config = load_config(
            getattr(config, "extra_config", None) or {},
            getattr(config, "blocking_timeout_secs", None),
            "remote connector",
        )
        self.runtime = StoreRuntime(self.kv_config, name="kvstore-connector")
        self.bridge = InProcessBridge(self.runtime, local_cpu_backend, count_inflight=False)
        log.info("kvstore remote connector ready: %s", self.kv_config.describe())

    def _name(self, key: CacheEngineKey) -> str:
        return self.bridge.names([key])[0]

    # ------------------------------------------------------------------ lookups
    async def exists(self, key: CacheEngineKey) -> bool:
        res = await self.runtime.acall(self.runtime.store.contains_many([self._name(key)]), [False], "exists")
        return bool(res[0])

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return bool(
            self.runtime.call(self.runtime.store.contains_many([self._name(key)]), [False], "exists")[0]
        )

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self.bridge.lookup(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self.bridge.alookup(keys)

    # -------------------------------------------------------------------- reads
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self.runtime.acall(
            self.bridge.read(self.bridge.names(keys)), [None] * len(keys), "read", release=self.bridge.release_read
        )

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        coro = self.bridge.read(self.bridge.names(keys), prefix_only=True)
        return await self.runtime.acall(coro, [], "read", release=self.bridge.release_read)

    # ------------------------------------------------------------------- writes
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        fut = self.bridge.write(keys, memory_objs)  # holds its own references until the write ends
        if fut is not None:
            done, _ = await asyncio.wait({asyncio.wrap_future(fut)}, timeout=self.kv_config.timeout_s)
            if not done:  # never cancel: the write keeps its reference until it ends
                self.runtime.counters.timeouts += 1
                log.warning(
                    "kvstore: write still running after %.1fs; continuing in the background",
                    self.kv_config.timeout_s,
                )

    # ------------------------------------------------------------ housekeeping
    def remove_sync(self, key: CacheEngineKey) -> bool:
        return bool(
            self.runtime.call(self.runtime.store.delete_many([self._name(key)]), [False], "remove")[0]
        )

    async def list(self) -> list[str]:
        return []

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        return self.runtime.wait_writes(timeout)

    def stats(self) -> dict[str, Any]:
        return self.runtime.stats()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.runtime.close)

    def __repr__(self) -> str:
        return f"<KVStoreRemoteConnector tiers={[t.redacted() for t in self.kv_config.tiers]}>"
