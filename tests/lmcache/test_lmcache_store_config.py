"""kvstore's settings from extra_config, KVSTORE_* and files: precedence and errors."""

from __future__ import annotations

import json

import pytest

from kvstore.store_config import StoreConfig, StoreConfigError, TierConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("KVSTORE_") and k != "KVSTORE_HOME":
            monkeypatch.delenv(k)


def test_extra_config_keys():
    cfg = StoreConfig.from_mapping(
        {
            "kvstore.tiers": ["mem://a?capacity=1MiB", {"url": "mem://b", "codec": "raw"}],
            "kvstore.namespace": "team-a",
            "kvstore.timeout_s": "2.5",
            "kvstore.max_pending": "64MiB",
            "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",  # not ours: ignored
        }
    )
    assert cfg.tiers == (TierConfig("mem://a?capacity=1MiB"), TierConfig("mem://b"))
    assert (cfg.namespace, cfg.timeout_s, cfg.max_pending) == ("team-a", 2.5, 64 << 20)


def test_env_then_extra_config_override(monkeypatch):
    monkeypatch.setenv("KVSTORE_TIERS", "mem://e1, mem://e2")
    monkeypatch.setenv("KVSTORE_NAMESPACE", "from-env")
    cfg = StoreConfig.from_mapping({"kvstore.namespace": "from-extra"})
    assert [t.url for t in cfg.tiers] == ["mem://e1", "mem://e2"]
    assert cfg.namespace == "from-extra"


def test_file_is_lowest(monkeypatch, tmp_path):
    f = tmp_path / "kv.json"
    f.write_text(json.dumps({"tiers": ["mem://f1", "mem://f2"], "namespace": "file", "timeout_s": 3}))
    monkeypatch.setenv("KVSTORE_CONFIG", str(f))
    monkeypatch.setenv("KVSTORE_TIMEOUT_S", "1")
    cfg = StoreConfig.from_mapping({})
    assert (cfg.namespace, cfg.timeout_s, len(cfg.tiers)) == ("file", 1.0, 2)
    assert StoreConfig.from_file(f).timeout_s == 3


def test_cold_codec_sets_last_tier():
    cfg = StoreConfig.from_mapping({"kvstore.tiers": "mem://a mem://b", "kvstore.cold_codec": "raw"})
    assert cfg.tiers[-1].codec == "raw"
    with pytest.raises(StoreConfigError, match="at least two tiers"):
        StoreConfig.from_mapping({"kvstore.tiers": ["mem://a"], "kvstore.cold_codec": "raw"})


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"kvstore.tiers": ["nosuch://x"]}, "unknown backend scheme"),
        ({"kvstore.tiers": [{"url": "mem://a", "codec": "zip"}]}, "codec 'zip': unknown codec"),
        ({"kvstore.tiers": "[not json"}, "not valid JSON"),
        ({"kvstore.tiers": []}, "empty"),
        ({"kvstore.tier": "mem://a"}, "unknown; known: kvstore.tiers"),
        ({"kvstore.timeout_s": "soon"}, "number of seconds"),
        ({"kvstore.max_pending": "lots"}, "cannot read size"),
        ({"kvstore.namespace": "a/b"}, "namespace"),
        ({"kvstore.policy": "random"}, "policy 'random' is unknown"),
        ({"kvstore.policy": "write-through"}, "lower tiers are written through by default"),
    ],
)
def test_errors_name_the_setting(mapping, message):
    with pytest.raises(StoreConfigError, match=message):
        StoreConfig.from_mapping(
            {"kvstore.tiers": ["mem://ok"], **mapping} if "kvstore.tiers" not in mapping else mapping
        )


def test_timeout_below_lmcache_deadline():
    cfg = StoreConfig.from_mapping({"kvstore.tiers": ["mem://a"], "kvstore.timeout_s": 10})
    with pytest.raises(StoreConfigError, match="blocking_timeout_secs"):
        cfg.validate(blocking_timeout_s=10)


def test_missing_file(tmp_path):
    with pytest.raises(StoreConfigError, match="cannot read kvstore config file"):
        StoreConfig.from_mapping({"kvstore.config_file": str(tmp_path / "nope.json")})
