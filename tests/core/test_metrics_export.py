"""kvstore's metrics where operators scrape: the opt-in port and the default registry.

A real HTTP scrape (urllib) of the port after a put and a get; several stores in one
process (no duplicate registration, a ``store`` label apart); the plugin runtime and the
MP L2 adapter exporting their counters and breaker states; bad port settings never
stopping a store.
"""

from __future__ import annotations

import logging
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import metrics_export
from kvstore.keys import ChunkKey
from kvstore.tiered import TieredStore
from tests.support.required import require_module

NAME = ChunkKey("m", 1, 0, 7, namespace="tenant-a").object_name()
OTHER = ChunkKey("m", 1, 0, 8, namespace="tenant-a").object_name()


@pytest.fixture(autouse=True)
def _no_server() -> Iterator[None]:
    metrics_export.stop_serving()
    yield
    metrics_export.stop_serving()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels include `labels` (None if absent)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_port_serves_store_metrics_after_put_and_get(tmp_path: Path) -> None:
    store = TieredStore.from_urls(["mem://mx-hot?capacity=1MiB", (tmp_path / "warm").as_uri()])
    try:
        label = metrics_export.export_store(store, name="scrape-test", port=0)
        port = metrics_export.served_port()
        assert port
        t = torch.randn(4, 64)
        assert await store.put_many([(NAME, t)]) == [True]
        got = await store.get_many([NAME, OTHER])
        assert got[0] is not None and got[1] is None

        text = scrape(port)
        lines = [ln for ln in text.splitlines() if f'store="{label}"' in ln]
        assert any(ln.startswith("kvstore_hits_total{") and 'tier="tier0"' in ln for ln in lines), text
        assert value(text, "kvstore_hits_total", store=label, tier="tier0", namespace="tenant-a") == 1
        assert value(text, "kvstore_misses_total", store=label, namespace="tenant-a") == 1
        assert (
            value(text, "kvstore_bytes_in_total", store=label, tier="tier0", namespace="tenant-a") > t.nbytes
        )
        assert value(text, "kvstore_bytes_out_total", store=label, tier="tier0", namespace="tenant-a") > 0
        assert value(text, "kvstore_op_seconds_count", store=label, op="get", tier="tier0") >= 1
        assert value(text, "kvstore_op_seconds_bucket", store=label, op="put", tier="tier0", le="+Inf") >= 1
        assert value(text, "kvstore_tier_objects", store=label, tier="tier0") == 1
        assert (
            value(text, "kvstore_tier_info", store=label, tier="tier1", codec="raw", backend="DiskBackend")
            == 1
        )
        assert value(text, "kvstore_backend_errors_total", store=label, tier="tier1", kind="put") == 0
        assert value(text, "kvstore_tier_misses_total", store=label, tier="tier0") is not None
        # the port serves kvstore's metrics only, not the process's default registry
        assert "python_gc_objects_collected_total" not in text
    finally:
        metrics_export.forget_store(store)
        await store.close()


async def test_several_stores_one_process_no_duplicates() -> None:
    a = TieredStore.from_urls(["mem://mx-a"])
    b = TieredStore.from_urls(["mem://mx-b"])
    try:
        la = metrics_export.export_store(a, name="dup")
        lb = metrics_export.export_store(b, name="dup")
        assert (la, lb) == ("dup", "dup-2")
        assert metrics_export.export_store(a, name="dup") == "dup"  # attaching again changes nothing
        metrics_export.register_default()  # twice: no "Duplicated timeseries"
        for store in (a, b):
            await store.put_many([(NAME, torch.ones(8))])
            await store.get_many([NAME])
        text = generate_latest(REGISTRY).decode()
        seen = set()
        for fam in text_string_to_metric_families(text):  # a valid exposition
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in seen, key
                seen.add(key)
        assert value(text, "kvstore_hits_total", store="dup", tier="tier0") == 1
        assert value(text, "kvstore_hits_total", store="dup-2", tier="tier0") == 1
    finally:
        for store in (a, b):
            metrics_export.forget_store(store)
            await store.close()
    text = generate_latest(REGISTRY).decode()
    assert value(text, "kvstore_hits_total", store="dup") is None  # closed stores leave the scrape


async def test_breaker_state_of_a_tier() -> None:
    require_module("aiobotocore")
    store = TieredStore.from_urls(
        ["mem://mx-br", "s3://no-bucket/p?endpoint_url=http://127.0.0.1:9&region=us-east-1"]
    )
    try:
        label = metrics_export.export_store(store, name="breaker-test", port=0)
        port = metrics_export.served_port()
        assert value(scrape(port), "kvstore_breaker_state", store=label, tier="tier1") == 0
        breaker = store.tiers[1].backend.breaker
        for _ in range(breaker.failure_threshold):
            breaker.record(False)
        assert value(scrape(port), "kvstore_breaker_state", store=label, tier="tier1") == 2
    finally:
        metrics_export.forget_store(store)
        await store.close()


def test_plugin_runtime_exports_its_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.store_config import StoreConfig
    from kvstore_lmcache.runtime import StoreRuntime

    monkeypatch.setenv(metrics_export.ENV_PORT, "0")
    rt = StoreRuntime(StoreConfig.from_mapping({"kvstore.tiers": "mem://mx-plugin"}), name="kvstore-plugin")
    try:
        port = metrics_export.served_port()
        assert port
        fut, chosen = rt.start_put(
            [(NAME, torch.ones(16), 64)],
            lambda idx: rt.store.put_many([(NAME, torch.ones(16))]),
            lambda i: None,
        )
        assert chosen == [0] and fut is not None
        assert fut.result(timeout=10) == [True]
        text = scrape(port)
        assert value(text, "kvstore_plugin_put_ok_total", store=rt.metrics_label) == 1
        assert value(text, "kvstore_plugin_pending_bytes", store=rt.metrics_label) == 0
        assert value(text, "kvstore_bytes_in_total", store=rt.metrics_label, tier="tier0") > 0
    finally:
        rt.close()
    assert value(scrape(port), "kvstore_plugin_put_ok_total", store=rt.metrics_label) is None


def test_l2_adapter_metrics_port_and_counters(tmp_path: Path) -> None:
    require_module("lmcache.v1.distributed.l2_adapters.base")
    from kvstore_lmcache.l2_adapter import KVStoreL2Adapter, KVStoreL2AdapterConfig
    from kvstore_lmcache.l2_sync import SyncL2, object_key

    with pytest.raises(ValueError, match="metrics_port"):
        KVStoreL2AdapterConfig.from_dict({"tiers": ["mem://x"], "metrics_port": "http"})
    ad = KVStoreL2Adapter({"tiers": ["mem://mx-l2", (tmp_path / "l2").as_uri()], "metrics_port": 0})
    try:
        port = metrics_export.served_port()
        assert port
        key = object_key(1, model="m/x")
        kv = torch.randn(2, 2, 16, 32).to(torch.bfloat16)
        assert SyncL2(ad).store([key], [kv])
        assert SyncL2(ad).lookup([key, object_key(2, model="m/x")]) == [True, False]
        text = scrape(port)
        assert value(text, "kvstore_l2_lookups_total", store="kvstore-l2") == 2
        assert value(text, "kvstore_l2_lookup_hits_total", store="kvstore-l2") == 1
        assert value(text, "kvstore_breaker_state", store="kvstore-l2", tier="tier1") == 0
        assert value(text, "kvstore_bytes_in_total", store="kvstore-l2", tier="tier1") > 0
        # and in the default registry, which lmcache server serves on --prometheus-port
        assert value(generate_latest(REGISTRY).decode(), "kvstore_l2_stores_total", store="kvstore-l2") == 1
    finally:
        ad.close()


async def test_bad_port_setting_never_stops_a_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = TieredStore.from_urls(["mem://mx-bad"])
    try:
        monkeypatch.setenv(metrics_export.ENV_PORT, "not-a-port")
        with caplog.at_level(logging.ERROR, logger="kvstore.metrics_export"):
            metrics_export.export_store(store, name="bad-port")
        assert metrics_export.served_port() is None
        assert re.search(r"KVSTORE_METRICS_PORT: cannot read 'not-a-port'", caplog.text)
        # a port already taken: logged with the fix, no exception
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            taken = s.getsockname()[1]
            monkeypatch.setenv(metrics_export.ENV_ADDR, "127.0.0.1")
            with caplog.at_level(logging.ERROR, logger="kvstore.metrics_export"):
                assert metrics_export.serve(taken) is None
        assert "pick a free port" in caplog.text
    finally:
        metrics_export.forget_store(store)
        await store.close()
