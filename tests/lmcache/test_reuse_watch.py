"""The one warning for a cache that a restarted server never reuses (keys that changed)."""

from __future__ import annotations

import logging
import time

import torch

from kvstore_lmcache.reuse_watch import ReuseWatch


def test_watch_warns_once_only_when_old_chunks_are_never_found():
    w = ReuseWatch(namespace="ns", min_existing=4, min_lookups=10, existing=4, complete=True)
    w.saw_lookups(9)
    assert not w.due() and w.check(0) is None
    w.saw_lookups(1)
    msg = w.check(0)
    assert msg is not None and "PYTHONHASHSEED" in msg and "'ns'" in msg
    w.saw_lookups(100)
    assert w.check(0) is None, "once"
    found = ReuseWatch(min_existing=4, min_lookups=10, existing=4, complete=True, lookups=10)
    assert found.check(reused=1) is None and not found.due(), "old chunks found: never warns"
    empty = ReuseWatch(min_existing=4, min_lookups=10, existing=3, complete=True, lookups=1000)
    assert empty.check(0) is None, "too few old chunks to mean anything"


def test_l2_adapter_warns_when_a_restart_finds_none_of_its_chunks(tmp_path, caplog):
    from kvstore_lmcache.l2_adapter import KVStoreL2Adapter, KVStoreL2AdapterConfig
    from kvstore_lmcache.l2_sync import SyncL2, object_key

    params = {"tiers": [f"file://{tmp_path}/disk?fsync=false"]}
    kv = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    first = KVStoreL2Adapter(KVStoreL2AdapterConfig.from_dict(params))
    assert SyncL2(first).store([object_key(i) for i in range(40)], [kv] * 40)
    first.close()

    def restart(lookup_from: int) -> KVStoreL2Adapter:
        ad = KVStoreL2Adapter(KVStoreL2AdapterConfig.from_dict(params))
        deadline = time.time() + 10
        while not ad.runtime.reuse.complete and time.time() < deadline:
            time.sleep(0.02)
        l2 = SyncL2(ad)
        for start in range(lookup_from, lookup_from + 300, 30):
            l2.lookup([object_key(i) for i in range(start, start + 30)])
        time.sleep(0.2)  # the check runs on the store's loop
        return ad

    with caplog.at_level(logging.WARNING, logger="kvstore.plugins"):
        changed = restart(lookup_from=1000)  # none of the new lookups is an old key
        changed.close()
    assert sum("PYTHONHASHSEED" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.plugins"):
        same = restart(lookup_from=0)  # the old keys are looked up again: reuse works
        same.close()
    assert not any("PYTHONHASHSEED" in r.getMessage() for r in caplog.records)
