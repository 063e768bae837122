"""`kvstore demo` end to end: a real model, the real LMCache engine, kvstore underneath."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ["mp", "plugin"])
def test_demo_loads_kv_back_and_continues_identically(tmp_path, monkeypatch, path):
    """mp (the default): a real `lmcache server` process with kvstore as its L2 adapter,
    restarted between passes; plugin: the in-process engine with the storage plugin."""
    from kvstore.cli.demo import demo

    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path))
    args = ["--json", "--path", path, "--prompts", "1", "--prompt-tokens", "257", "--chunk-size", "128", "--new-tokens", "4"]
    args += ["--tier", "mem://demo-test-hot", "--tier", f"file://{tmp_path / 'warm'}?fsync=false"]
    args += [
        "--tier",
        f"file://{tmp_path / 'cold'}?fsync=false",
        "--cold-codec",
        "cachegen?profile=smollm2-135m-mixq",
    ]
    res = CliRunner().invoke(demo, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{") :])
    assert rep["path"] == path
    if path == "mp":  # through /dev/shm where it has room for the server's L1, else in the requests
        assert set(rep["transfer"].split("/")) <= {"shm", "pickle", "inline"}, rep["transfer"]
    first, second = rep["passes"][0], rep["passes"][1]
    assert first["hit_tokens"] == 0
    p = second["prompts"][0]
    assert p["hit_tokens"] == 256, "both full chunks come back from kvstore"
    assert p["tokens_by_tier"] == {"1:file(raw)": 256}, (
        "the restarted hot tier is empty: the warm tier serves"
    )
    assert p["identical"], "raw tiers return the exact KV, so the continuation is the same"
    cold = rep["passes"][2]["prompts"][0]
    assert cold["hit_tokens"] == 256, "the cachegen tier alone serves both chunks"
    assert list(cold["tokens_by_tier"]) == ["1:file(cachegen?profile=smollm2-135m-mixq)"]
    assert sum(cold["bytes_by_tier"].values()) * 4 < sum(p["bytes_by_tier"].values()), "stored compressed"
    assert cold["agreement"] >= 0.5, "the calibrated profile keeps the continuation close"


def test_the_demo_moves_kv_in_the_requests_where_dev_shm_is_small(monkeypatch):
    """A container's default /dev/shm (64 MiB) cannot hold the server's L1 pool: the
    demo then sends the KV inside the requests instead of failing to start the server."""
    import os

    from kvstore.demo.mp import L1_SIZE_GB, shm_segment

    class Fs:
        f_frsize = 4096

        def __init__(self, nbytes: int) -> None:
            self.f_bavail = nbytes // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Fs(64 * 2**20))
    assert shm_segment(L1_SIZE_GB, "1") == ""
    monkeypatch.setattr(os, "statvfs", lambda path: Fs(8 * 2**30))
    assert shm_segment(L1_SIZE_GB, "1").startswith("kvstore-demo-")
