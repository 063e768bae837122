"""`kvstore doctor` against real servers: a tmp dir, a real redis-server, SeaweedFS S3.

Each test sets the environment a server would have (``LMCACHE_*``, ``KVSTORE_*``) or
hands the ``--l2-adapter`` JSON, runs the command, and checks the exit code, the failing
item it names, the fix it prints, and that its probe leaves nothing behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore.cli.main import cli
from kvstore.testing.redis_server import RedisServer, free_port, redis_available
from tests.support.required import REDIS_INSTALL, require

PLUGIN = {
    "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
    "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
}
REMOTE = {
    "remote_storage_plugin.kvstore.module_path": "kvstore_lmcache.remote_connector",
    "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
}


def adapter_json(**params: Any) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvstore_lmcache.l2_adapter",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": params,
        }
    )


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """env(**vars): a clean server environment (no LMCACHE_* / KVSTORE_* but KVSTORE_HOME)."""
    for name in list(os.environ):
        if name.startswith(("LMCACHE_", "KVSTORE_")) and name != "KVSTORE_HOME":
            monkeypatch.delenv(name)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_env


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["doctor", "--json", "--timeout", "10", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.output.strip().splitlines()[-1])


def check(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    found = [c for c in report["checks"] if c["name"].startswith(prefix)]
    assert found, (prefix, [c["name"] for c in report["checks"]])
    return found[0]


def leftovers(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


@pytest.fixture
def redis_srv() -> Any:
    require(redis_available(), "redis-server", REDIS_INSTALL)
    with RedisServer() as srv:
        yield srv


# --------------------------------------------------------------------------- success
def test_storage_plugin_with_disk_and_redis_passes(env, tmp_path: Path, redis_srv) -> None:
    disk = tmp_path / "kv"
    tiers = ["mem://doc-hot?capacity=64MiB", f"{disk.as_uri()}?capacity=1GiB", f"{redis_srv.url}?prefix=doc:"]
    env(
        LMCACHE_CHUNK_SIZE="256",
        LMCACHE_LOCAL_CPU="False",
        LMCACHE_MAX_LOCAL_CPU_SIZE="1",
        LMCACHE_STORAGE_PLUGINS="kvstore",
        LMCACHE_EXTRA_CONFIG=json.dumps({**PLUGIN, "kvstore.tiers": tiers, "kvstore.namespace": "prod"}),
        PYTHONHASHSEED="0",
        LMCACHE_INTERNAL_API_SERVER_ENABLED="True",
    )
    code, report = doctor()
    assert code == 0, report
    assert report["ok"] and report["mode"] == "in-process"
    assert check(report, "LMCache plugin")["status"] == "ok"
    for i in range(3):
        c = check(report, f"tier{i} ")
        assert c["status"] == "ok" and "read back verified" in c["detail"], c
    assert check(report, "PYTHONHASHSEED")["status"] == "ok"
    assert report["config"]["namespace"] == "prod"
    assert report["warnings"] == []
    assert "internal API server" in check(report, "metrics")["detail"]
    # the probes are gone: nothing on disk, nothing in Redis under the prefix
    assert leftovers(disk) == []
    assert redis_srv.command("KEYS", "doc:*").strip() in (b"", b"*0")


def test_text_report_and_hash_seed_warning(env, tmp_path: Path) -> None:
    env(KVSTORE_TIERS=f"mem://doc-t {(tmp_path / 'kv').as_uri()}?capacity=1GiB")
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "warn  PYTHONHASHSEED: unset" in result.output
    assert "export PYTHONHASHSEED=0" in result.output
    assert result.output.rstrip().splitlines()[-1].startswith("OK (")


def test_config_file(env, tmp_path: Path) -> None:
    env()
    path = tmp_path / "kvstore.json"
    path.write_text(
        json.dumps({"tiers": [f"{(tmp_path / 'kv').as_uri()}?capacity=1GiB"], "namespace": "file-ns"})
    )
    code, report = doctor("--config", str(path))
    assert code == 0, report
    assert report["config"]["namespace"] == "file-ns"
    assert "KVSTORE_CONFIG" in report["source"]
    assert "KVSTORE_CONFIG" not in os.environ  # the command leaves the environment as it was


def test_l2_adapter_json_passes_and_needs_no_hash_seed(env, tmp_path: Path) -> None:
    env()
    code, report = doctor(
        "--l2-adapter", adapter_json(tiers=["mem://doc-l2?capacity=64MiB", (tmp_path / "l2").as_uri()])
    )
    assert code == 0, report
    assert report["mode"] == "mp"
    hashes = check(report, "chunk hashes")
    assert hashes["status"] == "ok" and "blake3" in hashes["detail"] and "PYTHONHASHSEED" in hashes["detail"]
    assert not [c for c in report["checks"] if c["name"] == "PYTHONHASHSEED"]
    # the file tier has no capacity: a warning with the fix, not a failure
    budget = check(report, "tier1 budget")
    assert budget["status"] == "warn" and "capacity" in budget["fix"]


def test_s3_round_trip(env, s3_url) -> None:
    env(KVSTORE_TIERS=f"mem://doc-s3 {s3_url()}", PYTHONHASHSEED="1")
    code, report = doctor()
    assert code == 0, report
    detail = check(report, "tier1 s3://")["detail"]
    assert "read back verified" in detail and "streamed into a tensor" in detail  # the path LMCache's reads take


# --------------------------------------------------------------------------- failures
def test_a_redis_user_that_cannot_run_scripts_is_a_warning_with_the_fix(env, redis_srv) -> None:
    import redis

    r = redis.Redis(port=redis_srv.port)
    r.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "+@all", "-@scripting")
    url = f"redis://noscripts:pw@127.0.0.1:{redis_srv.port}/0"
    code, report = doctor("--l2-adapter", adapter_json(tiers=[url]))
    c = check(report, "tier0 ")
    assert c["status"] == "warn" and "checksummed before they are sent" in c["detail"], c
    assert "NOPERM" in c["detail"] and "+@scripting" in c["fix"]
    assert code == 0 and report["warnings"]  # a warning, not a failure
    assert r.keys("*") == []  # probes and the temporary key gone
    # the default user may: no warning
    code, report = doctor("--l2-adapter", adapter_json(tiers=[redis_srv.url]))
    assert check(report, "tier0 ")["status"] == "ok" and code == 0
    assert r.keys("*") == []


def test_unreachable_redis_is_named_with_the_fix(env, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.5"
    env(KVSTORE_TIERS=f"mem://doc-r {url}")
    code, report = doctor()
    assert code == 1
    assert report["failed"] == [check(report, "tier1 redis://")["name"]]
    c = check(report, "tier1 redis://")
    assert c["status"] == "FAIL" and "redis-server" in c["fix"]
    assert check(report, "tier0 ")["status"] == "ok"  # the other tiers are still checked


def test_stopped_redis_fails_then_passes_once_started(env, redis_srv) -> None:
    env(KVSTORE_TIERS=f"{redis_srv.url}?connect_timeout=0.5")
    redis_srv.stop()
    code, report = doctor()
    assert code == 1 and report["failed"][0].startswith("tier0 redis://")
    redis_srv.start()
    code, report = doctor()
    assert code == 0, report


def test_wrong_s3_credentials(env, s3_url, monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3_url()
    env(KVSTORE_TIERS=f"mem://doc-s3bad {url}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, report = doctor()
    assert code == 1
    c = check(report, "tier1 s3://")
    assert c["status"] == "FAIL" and report["failed"] == [c["name"]]
    assert "AWS_ACCESS_KEY_ID" in c["fix"] and "credentials" in c["detail"]
    assert "not-the-secret" not in json.dumps(report)


def test_unwritable_dir(env, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env(KVSTORE_TIERS=f"mem://doc-d {(blocker / 'kv').as_uri()}?capacity=1GiB")
    code, report = doctor()
    assert code == 1
    c = check(report, "tier1 file://")
    assert c["status"] == "FAIL" and "cannot be opened" in c["detail"]
    assert "writable" in c["fix"] or "writ" in c["fix"]


def test_invalid_settings_exit_2_with_the_plugins_message(env) -> None:
    env(KVSTORE_TIERS="mem://x", KVSTORE_POLICY="nosuch")
    code, report = doctor()
    assert code == 2
    c = check(report, "kvstore settings")
    assert c["status"] == "FAIL" and "kvstore.policy 'nosuch' is unknown" in c["detail"]


def test_bad_extra_config_json(env) -> None:
    env(LMCACHE_STORAGE_PLUGINS="kvstore", LMCACHE_EXTRA_CONFIG="{'kvstore.tiers': 'mem://x'}")
    code, report = doctor()
    assert code == 2
    assert report["failed"] == ["LMCACHE_EXTRA_CONFIG"]
    assert "ignores all of it" in check(report, "LMCACHE_EXTRA_CONFIG")["detail"]


def test_lmcache_would_refuse_the_plugin(env, tmp_path: Path) -> None:
    env(
        LMCACHE_MAX_LOCAL_CPU_SIZE="0",
        LMCACHE_REMOTE_STORAGE_PLUGINS="kvstore",
        LMCACHE_EXTRA_CONFIG=json.dumps({**REMOTE, "kvstore.tiers": ["mem://doc-rc"]}),
    )
    code, report = doctor()
    assert code == 1
    c = check(report, "LMCache plugin")
    assert c["status"] == "FAIL" and "LMCACHE_MAX_LOCAL_CPU_SIZE" in c["fix"]


def test_l2_adapter_bad_params_exit_2(env) -> None:
    env()
    code, report = doctor("--l2-adapter", adapter_json(tiers=["mem://x"], lock_ttl=3))
    assert code == 2
    c = check(report, "--l2-adapter")
    assert c["status"] == "FAIL" and "lock_ttl" in c["detail"] and "unknown" in c["detail"]
    code, report = doctor("--l2-adapter", '{"type": "plugin"')
    assert code == 2 and "Invalid JSON" in check(report, "--l2-adapter")["detail"]


def test_metrics_exposure(env, tmp_path: Path) -> None:
    env()
    tiers = ["mem://doc-m"]
    code, report = doctor("--l2-adapter", adapter_json(tiers=tiers))
    c = check(report, "metrics")
    assert code == 0 and c["status"] == "warn"
    assert "lmcache server" in c["detail"] and "metrics_port" in c["fix"]
    port = free_port()
    code, report = doctor("--l2-adapter", adapter_json(tiers=tiers, metrics_port=port))
    c = check(report, "metrics")
    assert code == 0 and c["status"] == "ok" and f":{port}/metrics" in c["detail"]
    env(KVSTORE_TIERS="mem://doc-m2", KVSTORE_METRICS_PORT="http")
    code, report = doctor()
    assert code == 1 and report["failed"] == ["metrics"]


def test_hung_redis_fails_within_the_deadline(env, redis_srv) -> None:
    import time

    env(KVSTORE_TIERS=f"mem://doc-h {redis_srv.url}?connect_timeout=0.5&timeout=1")
    redis_srv.pause()  # SIGSTOP: accepts connections, never answers
    try:
        t0 = time.monotonic()
        result = CliRunner().invoke(cli, ["doctor", "--timeout", "3"])
        assert time.monotonic() - t0 < 30
    finally:
        redis_srv.resume()
    assert result.exit_code == 1, result.output
    assert result.output.rstrip().splitlines()[-1].startswith("FAILED: tier1 redis://")
    assert "fix: start redis-server there" in result.output


def test_l2_adapter_json_from_a_file(env, tmp_path: Path) -> None:
    env()
    path = tmp_path / "adapter.json"
    path.write_text(adapter_json(tiers=[f"{(tmp_path / 'kv').as_uri()}?capacity=1GiB"], namespace="mp-ns"))
    code, report = doctor("--l2-adapter", str(path))
    assert code == 0, report
    assert report["config"]["namespace"] == "mp-ns"
