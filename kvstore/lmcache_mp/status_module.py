"""An LMCache ``--server-module`` that tells clients whether L2 writes have landed.

Owns: two namespaced server-module methods, answered inside the MP server process:

- ``kvstore.l2_status``: the store controllers' queue (``pending_keys_count``,
  ``in_flight_task_count`` per L1), L1 occupancy and each L2 adapter's
  ``report_status()``, as JSON.
- ``kvstore.l2_contains``: for a token list, which chunk objects every L2 adapter holds
  now, asked through the adapters' own ``submit_lookup_and_lock_task`` (then unlocked).

Must not touch: stored data (it only looks up and unlocks), the L1 cache, the
prefetch path, or anything outside the server it is loaded into.

Loaded with ``--server-module '{"module_path":"kvstore.lmcache_mp.status_module"}'``
(`kvstore.lmcache_mp.server.MPServer` does so by default): LMCache 0.5.6 calls its
factory `build_server_modules`, 0.5.7 and later build `KVStoreStatusServerModule`; called by
`kvstore.lmcache_mp.client.MPClient.wait_stored`.  LMCache 0.5.6's request protocol has
no such request of its own: L2 stores are asynchronous and only the HTTP frontend's
``/status`` shows the store queue.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from lmcache.v1.distributed.api import ipc_key_to_object_keys
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.ext_server_module import server_module_handler

try:  # LMCache 0.5.7 and later: server modules are classes it discovers
    from lmcache.v1.multiprocess.engine_module import DiscoverableModule
except ImportError:  # 0.5.6: the factory `build_server_modules`
    DiscoverableModule = None

if TYPE_CHECKING:
    from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
    from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext

STATUS_METHOD = "kvstore.l2_status"
CONTAINS_METHOD = "kvstore.l2_contains"


class KVStoreStatusModule:
    """The server-side half of `MPClient.wait_stored`."""

    def __init__(self, ctx: MPCacheServerContext) -> None:
        self._ctx = ctx

    @property
    def context(self) -> MPCacheServerContext:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {"kvstore_status_module": {"methods": [STATUS_METHOD, CONTAINS_METHOD]}}

    def close(self) -> None:
        return None

    @server_module_handler(STATUS_METHOD)
    def l2_status(self, payload: bytes) -> bytes:
        """JSON: ``{"pid", "idle": bool, "l1_used_bytes", "l1_total_bytes", "num_l2_adapters",
        "store_controllers": {...}, "l2_adapters": [...]}``.

        ``idle`` is true when no L1 store controller has keys queued or L2 store tasks
        in flight.  A key is briefly in neither between the controller popping its
        queue and submitting the task, so callers should see ``idle`` twice in a row
        (or use `l2_contains`)."""
        status = self._ctx.storage_manager.report_status()
        stores: dict[str, Any] = status.get("store_controllers", {})
        idle = all(
            s.get("pending_keys_count", 0) == 0 and s.get("in_flight_task_count", 0) == 0
            for s in stores.values()
        )
        used, total = self._ctx.storage_manager.get_l1_usage()
        answer = {
            "pid": os.getpid(),
            "idle": idle,
            "l1_used_bytes": used,
            "l1_total_bytes": total,
            "num_l2_adapters": status.get("num_l2_adapters", 0),
            "store_controllers": stores,
            "l2_adapters": status.get("l2_adapters", []),
        }
        return json.dumps(answer, default=str).encode()

    @server_module_handler(CONTAINS_METHOD)
    def l2_contains(self, payload: bytes) -> bytes:
        """Request JSON: ``model_name, world_size, worker_id, token_ids, end,
        cache_salt, timeout``.  Answer JSON: ``{"chunks": n, "adapters": [{"index",
        "type", "present": [bool per chunk]}]}`` for the chunks in ``[0, end)``."""
        req = json.loads(payload)
        tokens = [int(t) for t in req["token_ids"]]
        key = IPCCacheServerKey.from_token_ids(
            model_name=req["model_name"],
            world_size=int(req["world_size"]),
            worker_id=int(req["worker_id"]),
            token_ids=tokens,
            start=0,
            end=int(req["end"]),
            request_id="kvstore-l2-contains",
            cache_salt=req.get("cache_salt", ""),
            num_kv_readers=1,
        )
        hashes = self._ctx.token_hasher.compute_chunk_hashes(tokens, end=key.end)
        obj_keys = ipc_key_to_object_keys(key, hashes, [0])[0]
        deadline = time.monotonic() + float(req.get("timeout", 10.0))
        layouts = self._ctx.layout_desc_registry.find_group_layout_descs(key.model_name, key.world_size) or {}
        adapters = []
        for desc, adapter in self._ctx.storage_manager.l2_adapters():
            present = [False] * len(obj_keys)
            if obj_keys:
                task_id = adapter.submit_lookup_and_lock_task(obj_keys, layouts)
                bitmap = adapter.query_lookup_and_lock_result(task_id)
                while bitmap is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"L2 adapter {desc.index} lookup did not finish")
                    time.sleep(0.005)
                    bitmap = adapter.query_lookup_and_lock_result(task_id)
                present = [bool(bitmap.test(i)) for i in range(len(obj_keys))]
                locked = [k for k, hit in zip(obj_keys, present) if hit]
                if locked:
                    adapter.submit_unlock(locked)
            adapters.append({"index": desc.index, "type": desc.type_name, "present": present})
        return json.dumps({"chunks": len(obj_keys), "adapters": adapters}).encode()


def build_server_modules(build_ctx: ExtServerModuleBuildContext) -> KVStoreStatusModule:
    """The ``--server-module`` factory (LMCache 0.5.6)."""
    return KVStoreStatusModule(build_ctx.server_context)


if DiscoverableModule is not None:

    class KVStoreStatusServerModule(KVStoreStatusModule, DiscoverableModule):
        """The module as LMCache 0.5.7 and later load it: the server imports
        ``module_path`` and builds each concrete ``DiscoverableModule`` subclass in it."""

        module_name = "kvstore_status"

        @classmethod
        def create(cls, build_ctx: Any) -> KVStoreStatusServerModule:
            return cls(build_ctx.engine_context)
