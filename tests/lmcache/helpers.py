"""Helpers for the LMCache tests: engine geometry, LMCACHE_* environments, KV tensors."""

from __future__ import annotations

import json

import torch

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 16

PLUGIN_EXTRA = {
    "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
    "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
}
REMOTE_EXTRA = {
    "remote_storage_plugin.kvstore.module_path": "kvstore_lmcache.remote_connector",
    "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
}


def lmcache_env(path: str, asyncm: bool, tiers: list, extra: dict | None = None) -> dict[str, str]:
    """The LMCACHE_* variables that load kvstore through `path` ("plugin" or "remote")."""
    env = {
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        "LMCACHE_LOCAL_CPU": "False",  # LMCache's own CPU cache off: every hit comes from kvstore
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",
        "LMCACHE_ENABLE_ASYNC_LOADING": str(asyncm),
        "LMCACHE_BLOCKING_TIMEOUT_SECS": "5",
    }
    cfg = {"kvstore.tiers": tiers, **(extra or {})}
    if path == "plugin":
        env["LMCACHE_STORAGE_PLUGINS"] = "kvstore"
        cfg.update(PLUGIN_EXTRA)
    else:
        env["LMCACHE_REMOTE_STORAGE_PLUGINS"] = "kvstore"
        env["LMCACHE_REMOTE_SERDE"] = "naive"
        cfg.update(REMOTE_EXTRA)
    env["LMCACHE_EXTRA_CONFIG"] = json.dumps(cfg)
    return env


def random_kv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(torch.bfloat16),
            torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]


def empty(tokens: int):
    from kvstore.demo.hf_connector import empty_kv

    return empty_kv(LAYERS, HEADS, tokens, HEAD_DIM, torch.bfloat16)


def cpu_bytes_in_use(eng) -> int:
    """Bytes LMCache's CPU allocator has handed out and not got back (0 = no leaked MemoryObj)."""
    alloc = eng.engine.storage_manager.storage_backends["LocalCPUBackend"].get_memory_allocator()
    return alloc.pin_allocator.total_allocated_size
