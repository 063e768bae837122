"""kvstore as an LMCache storage plugin (``StoragePluginInterface``).

Load it with::

    LMCACHE_STORAGE_PLUGINS=kvstore
    LMCACHE_EXTRA_CONFIG='{"storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
                           "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
                           "kvstore.tiers": ["mem://hot?capacity=2GiB", "file:///var/cache/kv"]}'

Owns: translating LMCache's backend calls into store calls.  Must not touch:
storage logic (the store), LMCache's loop (reads it is asked for on that loop are
awaited through the plugin's own loop, with a deadline).

Threading: ``batched_submit_put_task`` runs on the inference thread and LMCache drops
its reference when it returns, so the plugin takes a reference (``ref_count_up``),
hands the write to its own loop and returns at once; the reference is released when
the write ends.  Blocking calls wait at most ``kvstore.timeout_s`` (below LMCache's
``blocking_timeout_secs``); a timeout or a fault is a miss and a counted error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvstore_lmcache.bridge import InProcessBridge
from kvstore_lmcache.runtime import StoreRuntime, load_config, log


class KVStoreStoragePlugin(StoragePluginInterface):
    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        if local_cpu_backend is None:
            msg = (
                "the kvstore storage plugin needs LMCache's CPU backend as its allocator; "
                "set LMCACHE_MAX_LOCAL_CPU_SIZE > 0 (LMCACHE_LOCAL_CPU may stay False)"
            )
            log.error("kvstore storage plugin is NOT loaded: %s", msg)
            raise ValueError(msg)
        extra = getattr(config, "extra_config", None) or {}
        blocking = getattr(config, "blocking_timeout_secs", None)
        self.kv_config = load_config(extra, blocking, "storage plugin")
        self.runtime = StoreRuntime(self.kv_config, name="kvstore-plugin")
        self.bridge = InProcessBridge(self.runtime, local_cpu_backend, count_inflight=True)
        log.info("kvstore storage plugin ready: %s", self.kv_config.describe())

    def __str__(self) -> str:
        return "KVStoreStoragePlugin"

    def _name(self, key: CacheEngineKey) -> str:
        return self.bridge.names([key])[0]

    # ------------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self.bridge.lookup(keys, pin)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self.bridge.alookup(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.runtime.inflight(self._name(key)) is not None

    # ------------------------------------------------------------------- writes
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[concurrent.futures.Future] | None:
        def done(i: int) -> None:
            if on_complete_callback is not None:
                try:
                    on_complete_callback(keys[i])
                except Exception as exc:
                    log.warning("kvstore: on_complete_callback for %s failed: %s", keys[i], exc)

        fut = self.bridge.write(keys, objs, done)
        return [fut] if fut is not None else None

    async def async_batched_submit_put_task(
        self, keys, objs, transfer_spec=None, on_complete_callback=None
    ) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    # -------------------------------------------------------------------- reads
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The chunks (None: a miss), after this process's writes of them, all within one
        ``kvstore.timeout_s``."""
        names = self.bridge.names(keys)
        deadline = time.monotonic() + self.kv_config.timeout_s
        self.bridge.wait_written(names, self.kv_config.timeout_s)
        got = self.bridge.read_now(names, deadline - time.monotonic())
        if got is not None:
            return got
        return self.runtime.call(
            self.bridge.read(names),
            [None] * len(keys),
            "read",
            release=self.bridge.release_read,
            timeout=deadline - time.monotonic(),
        )

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        names = self.bridge.names(keys)
        deadline = time.monotonic() + self.kv_config.timeout_s
        pending = [f for f in (self.runtime.inflight(n) for n in names) if f is not None]
        if pending:
            await asyncio.wait(
                [asyncio.wrap_future(f) for f in set(pending)], timeout=self.kv_config.timeout_s
            )
        return await self.runtime.acall(
            self.bridge.read(names, prefix_only=True),
            [],
            "read",
            release=self.bridge.release_read,
            timeout=deadline - time.monotonic(),
        )

    # ------------------------------------------------------------ housekeeping
    def pin(self, key: CacheEngineKey) -> bool:
        self.runtime.store.pin([self._name(key)])
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        self.runtime.store.unpin([self._name(key)])
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.runtime.call(self.runtime.store.delete_many([self._name(key)]), [False], "remove")[0]

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        names = [self._name(k) for k in keys]
        return sum(self.runtime.call(self.runtime.store.delete_many(names), [False] * len(names), "remove"))

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        return self.runtime.wait_writes(timeout)

    def stats(self) -> dict[str, Any]:
        return self.runtime.stats()

    def close(self) -> None:
        self.runtime.close()
