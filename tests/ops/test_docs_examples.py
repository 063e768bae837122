"""The worked examples of docs/lmcache.md, run as written.

Every ``sh`` block that starts a server is run by ``bash`` with ``lmcache`` and ``vllm``
replaced by shell functions that record their arguments, so quoting, line continuations
and ``export`` lines are exactly the shell's.  The recorded ``lmcache server`` arguments
go through the installed server's own argument parser and LMCache's L2 adapter config
parser, the adapter's ``adapter_params`` through kvstore's validation, and each adapter
JSON through LMCache's conformance check (``basic_check --mode test_l2_adapter``) with
the disk path, the Redis host and the S3 endpoint pointed at a temporary directory, a
local ``redis-server`` and a local SeaweedFS.  The in-process blocks' variables are
validated as the plugins read them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from tests.support.lmcache_check import assert_l2_conformance
from tests.support.required import require_module

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "lmcache.md"

require_module("lmcache.v1.distributed.l2_adapters.base")


def blocks(lang: str) -> list[str]:
    return [
        body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", DOC.read_text(), re.M | re.S) if tag == lang
    ]


def run_block(block: str, tmp_path: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Run a sh block in bash: the arguments `lmcache` / `vllm` got, and the environment it left."""
    record = tmp_path / "calls"
    record.mkdir(exist_ok=True)
    stubs = (
        'lmcache() { printf "%s\\0" "$@" > "$RECORD/lmcache"; }\n'
        'vllm() { printf "%s\\0" "$@" > "$RECORD/vllm"; }\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "RECORD": str(record)}
    done = subprocess.run(
        ["bash", "-c", stubs + "set -euo pipefail\n" + block + '\nenv -0 > "$RECORD/env"'],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == 0, f"{block}\n{done.stderr}"
    calls = {
        p.name: p.read_text().split("\0")[:-1] for p in record.iterdir() if p.name in ("lmcache", "vllm")
    }
    left = dict(line.split("=", 1) for line in (record / "env").read_text().split("\0") if "=" in line)
    for p in record.iterdir():
        p.unlink()
    return calls, left


SERVER_BLOCKS = [b for b in blocks("sh") if "lmcache server" in b]
INPROCESS_BLOCKS = [b for b in blocks("sh") if "export LMCACHE_" in b]


def test_the_doc_has_the_examples_it_promises() -> None:
    assert len(SERVER_BLOCKS) == 4  # disk, disk + Redis, disk + S3, disk with LMCache's eviction
    assert len(INPROCESS_BLOCKS) == 3
    assert len(blocks("toml")) == 1


def server_args(argv: list[str]):
    import argparse

    from lmcache.cli.commands.server import ServerCommand

    assert argv[0] == "server"
    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    return parser.parse_args(argv[1:])


def adapter_specs(argv: list[str]) -> list[dict]:
    return [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--l2-adapter"]


@pytest.mark.parametrize("n", range(len(SERVER_BLOCKS)))
def test_server_example_is_accepted_by_lmcache_and_kvstore(n: int, tmp_path: Path) -> None:
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.multiprocess.config import parse_args_to_mp_server_config

    from kvstore_lmcache.l2_adapter import KVStoreL2AdapterConfig, store_capacity

    calls, _ = run_block(SERVER_BLOCKS[n], tmp_path)
    argv = calls["lmcache"]
    args = server_args(argv)
    mp = parse_args_to_mp_server_config(args)
    assert mp.hash_algorithm == "blake3" and mp.chunk_size == 256
    adapters = parse_args_to_config(args).l2_adapter_config.adapters
    (spec,) = adapter_specs(argv)
    assert len(adapters) == 1
    cfg = KVStoreL2AdapterConfig.from_dict(spec["adapter_params"])
    assert cfg.store.timeout_s == 1.0
    # the same disk tier, with the same budget, in every example
    assert cfg.store.tiers[0].url == "file:///var/cache/kvstore?capacity=500GiB&fsync=false"
    if "eviction" in spec:
        assert adapters[0].eviction_config is not None
        assert store_capacity(cfg.store) > 0, "LMCache's eviction needs a capacity on every tier"
    for i, tier in enumerate(cfg.store.tiers[1:], 1):
        assert cfg.store.write_mode(i) == ("back" if tier.url.startswith("s3://") else "through")


def local_url(url: str, tmp_path: Path, redis, s3) -> str:
    """A doc tier URL with its place replaced by a local one; the store options stay."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return urlunsplit(parts._replace(path=str(tmp_path / "disk")))
    if parts.scheme == "redis":
        return urlunsplit(parts._replace(netloc=urlsplit(redis.url).netloc))
    if parts.scheme == "s3":
        query = dict(parse_qsl(parts.query))
        query.update(endpoint_url=s3.endpoint, region=s3.region)
        return urlunsplit(parts._replace(query=urlencode(query)))
    raise AssertionError(f"no local stand-in for {url}")


@pytest.mark.parametrize("n", range(len(SERVER_BLOCKS)))
def test_server_example_passes_lmcache_conformance_check(n: int, tmp_path: Path, request) -> None:
    calls, _ = run_block(SERVER_BLOCKS[n], tmp_path)
    (spec,) = adapter_specs(calls["lmcache"])
    tiers = spec["adapter_params"]["tiers"]
    schemes = {urlsplit(u).scheme for u in tiers}
    redis = request.getfixturevalue("redis_session") if "redis" in schemes else None
    s3 = request.getfixturevalue("seaweed") if "s3" in schemes else None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVSTORE_", "AWS_"))}
    if s3 is not None:
        for url in tiers:
            if url.startswith("s3://"):
                s3.create_bucket(urlsplit(url).netloc)
        env.update(s3.env())
    spec["adapter_params"]["tiers"] = [local_url(u, tmp_path, redis, s3) for u in tiers]
    # the examples' serving deadline (1 s) is about latency, which a loaded test machine
    # cannot promise; this test checks the configuration and the data path
    spec["adapter_params"]["timeout_s"] = 30
    assert_l2_conformance(spec, tmp_path, env)


def test_vllm_example_uses_the_mp_connector_keys_lmcache_knows(tmp_path: Path) -> None:
    import lmcache.integration.vllm as integration

    (block,) = [b for b in blocks("") + blocks("sh") if "vllm serve" in b and "LMCacheMPConnector" in b]
    calls, _ = run_block(block, tmp_path)
    argv = calls["vllm"]
    assert argv[0] == "serve"
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LMCacheMPConnector" and config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": 5555,
    }
    # every lmcache.mp.* key the doc names is one LMCache's connector reads
    source = "".join(
        (Path(integration.__file__).parent / f).read_text()
        for f in ("lmcache_mp_connector.py", "vllm_multi_process_adapter.py")
    )
    for key in set(re.findall(r"lmcache\.mp\.([a-z_]+)", DOC.read_text())):
        assert f"lmcache.mp.{key}" in source or re.search(rf"^\s+{key} = ", source, re.M), key


@pytest.mark.parametrize("n", range(len(INPROCESS_BLOCKS)))
def test_inprocess_example_is_accepted_by_the_plugins(n: int, tmp_path: Path, monkeypatch) -> None:
    import importlib

    from kvstore.store_config import StoreConfig

    _, env = run_block(INPROCESS_BLOCKS[n], tmp_path)
    assert env.get("PYTHONHASHSEED"), "in-process reuse under vLLM needs a fixed hash seed"
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    for kind in ("storage_plugin", "remote_storage_plugin"):
        if f"{kind}.kvstore.module_path" in extra:
            module = importlib.import_module(extra[f"{kind}.kvstore.module_path"])
            assert hasattr(module, extra[f"{kind}.kvstore.class_name"])
    if "LMCACHE_REMOTE_STORAGE_PLUGINS" in env:
        assert env["LMCACHE_REMOTE_SERDE"] == "naive"
    for key in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("KVSTORE_"):
            monkeypatch.setenv(key, value)
    cfg = StoreConfig.from_mapping(extra)
    cfg.validate(blocking_timeout_s=10.0)
    assert cfg.timeout_s == 1.0
    assert "file:///var/cache/kvstore?capacity=500GiB&fsync=false" in [t.url for t in cfg.tiers]


def test_toml_example_is_accepted(tmp_path: Path) -> None:
    from kvstore.store_config import StoreConfig

    pytest.importorskip("tomllib")
    (text,) = blocks("toml")
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    cfg = StoreConfig.from_file(path)
    assert cfg.tiers[-1].codec == "cachegen?profile=smollm2-135m-mixq" and cfg.timeout_s == 1.0
    assert cfg.tiers[1].url == "file:///var/cache/kvstore?capacity=500GiB&fsync=false"


def test_adapter_json_outline_is_json() -> None:
    (outline,) = [b for b in blocks("json") if "KVStoreL2Adapter" in b]
    spec = json.loads(outline)
    assert set(spec) == {"type", "module_path", "class_name", "adapter_params", "eviction"}
