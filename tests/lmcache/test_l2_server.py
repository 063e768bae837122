"""kvstore's L2 adapter inside a real ``lmcache.v1.multiprocess.server`` process on CPU.

A CPU engine worker (`kvstore.lmcache_mp.MPClient`, LMCache's own transport) stores and
retrieves KV of SmolLM2-135M's geometry (30 layers x 3 KV heads x 64 dims, bf16, 256-token
chunks) through the server; every byte below the server's L1 goes through kvstore.

* disk: bytes equal, a partial prefix hit, L1 cleared (served from kvstore), SIGKILL
  and restart of the server finds what it stored;
* Redis and S3: the tier SIGSTOPped or killed during a retrieve is a miss within the
  deadline, the server stays up, and after the tier returns the chunks hit again;
* a bad adapter setting stops the server with the setting named.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.required import REDIS_INSTALL, SEAWEED_INSTALL, needs, require, require_module

require_module("lmcache")
torch = require_module("torch")

from kvstore.lmcache_mp import MPClient, MPServer, MPServerError, plugin_l2_adapter, random_kv  # noqa: E402
from kvstore.testing.redis_server import RedisServer, redis_available  # noqa: E402
from kvstore.testing.seaweed import SeaweedS3, weed_binary  # noqa: E402

MODEL, LAYERS, HEADS, HEAD_DIM, CHUNK = "HuggingFaceTB/SmolLM2-135M", 30, 3, 64, 256
TIMEOUT_S = 2.0  # the adapter's per-task deadline in these tests (each tier gets half)


def kvstore_adapter(tiers: list[str], **params: object) -> dict[str, object]:
    return plugin_l2_adapter(
        "kvstore_lmcache.l2_adapter", "KVStoreL2Adapter", {"tiers": tiers, "namespace": "mp-test", **params}
    )


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49_152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def client(server: MPServer) -> MPClient:
    c = MPClient(server.url, MODEL, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, CHUNK)
    c.register()
    return c


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def disk_server(tmp_path: Path) -> Iterator[MPServer]:
    spec = kvstore_adapter(["mem://mp-hot?capacity=256MiB", f"file://{tmp_path / 'disk'}?fsync=false"])
    with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=tmp_path / "server.log") as server:
        yield server


def test_store_retrieve_partial_hits_and_restart(disk_server: MPServer, tmp_path: Path) -> None:
    toks = tokens(4 * CHUNK + 40, seed=1)
    kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=1)
    with client(disk_server) as c:
        assert c.store(toks[: 2 * CHUNK], kv[:, :, : 2 * CHUNK]) == 2 * CHUNK
        assert c.wait_stored(toks[: 2 * CHUNK], timeout=60)
        c.clear_l1()
        assert c.lookup(toks) == 2 * CHUNK, "two of four chunks stored: a partial prefix hit"
        assert c.store(toks, kv) == 4 * CHUNK
        assert c.wait_stored(toks, timeout=60)
        c.clear_l1()  # from here on every hit is read from kvstore
        hit, got = c.retrieve(toks)
        assert hit == 4 * CHUNK and bytes_equal(got, kv[:, :, :hit])
        other = tokens(2 * CHUNK, seed=2)
        assert c.lookup(other) == 0

    disk_server.kill()  # kill -9: L1 and the hot tier are gone, the disk tier is not
    disk_server.start()
    with client(disk_server) as c:
        hit, got = c.retrieve(toks)
        assert hit == 4 * CHUNK, "a restarted server finds what the killed one stored"
        assert bytes_equal(got, kv[:, :, :hit])
    files = [p for p in (tmp_path / "disk" / "objects").rglob("*") if p.is_file()]
    assert len(files) >= 4


def test_two_salts_and_two_models_do_not_share(disk_server: MPServer) -> None:
    toks = tokens(CHUNK, seed=3)
    kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=3)
    with client(disk_server) as c:
        assert c.store(toks, kv) == CHUNK
        assert c.wait_stored(toks, timeout=60)
    salted = MPClient(disk_server.url, MODEL, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, CHUNK, cache_salt="tenant-b")
    salted.register()
    other = MPClient(disk_server.url, "another/model", LAYERS, HEADS, HEAD_DIM, torch.bfloat16, CHUNK)
    other.register()
    with salted, other:
        salted.clear_l1()
        assert salted.lookup(toks) == 0
        assert other.lookup(toks) == 0


def test_bad_setting_stops_the_server_and_names_it(tmp_path: Path) -> None:
    spec = kvstore_adapter(["file:///tmp/x"], timeout_s="soon")
    server = MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.1, log_path=tmp_path / "bad.log", start_timeout=60)
    with pytest.raises(MPServerError, match="timeout_s"):
        server.start()
    server.stop()


# ---------------------------------------------------------------- remote tiers, faults
def _outage(server: MPServer, pause, resume) -> None:
    toks = tokens(3 * CHUNK, seed=5)
    kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=5)
    with client(server) as c:
        assert c.store(toks, kv) == 3 * CHUNK
        assert c.wait_stored(toks, timeout=60)
        c.clear_l1()
        pause()
        try:
            t = time.monotonic()
            hit, _ = c.retrieve(toks)
            took = time.monotonic() - t
            assert hit == 0, "nothing can come from a tier that does not answer"
            assert took < 4 * TIMEOUT_S + 2, f"retrieve took {took:.1f}s with a {TIMEOUT_S}s deadline"
            t = time.monotonic()
            assert c.lookup(toks) == 0
            assert time.monotonic() - t < 1.0, "after a deadline miss the adapter fails fast"
            assert server.running
        finally:
            resume()
        deadline = time.monotonic() + 60
        hit = 0
        while time.monotonic() < deadline:
            c.clear_l1()
            hit, got = c.retrieve(toks)
            if hit == 3 * CHUNK:
                break
            time.sleep(0.5)
        assert hit == 3 * CHUNK, "once the tier answers again the chunks hit"
        assert bytes_equal(got, kv)


@needs(redis_available(), "redis-server", REDIS_INSTALL)
@pytest.mark.parametrize("fault", ["sigstop", "kill"])
def test_redis_tier_outage_is_a_miss_within_the_deadline(tmp_path: Path, fault: str) -> None:
    persist = ["--appendonly", "yes", "--appendfsync", "always"]
    with RedisServer(extra=persist, workdir=tmp_path / "redis") as redis:
        spec = kvstore_adapter([redis.url], timeout_s=TIMEOUT_S)
        with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=tmp_path / "server.log") as server:
            if fault == "sigstop":
                _outage(server, redis.pause, redis.resume)
            else:
                _outage(server, redis.kill, redis.restart)


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedS3]:
    require(weed_binary() is not None, "SeaweedFS (weed)", SEAWEED_INSTALL)
    with SeaweedS3() as s3:
        s3.create_bucket("kvstore-mp")
        yield s3


@pytest.mark.parametrize("fault", ["sigstop", "kill"])
def test_s3_tier_outage_is_a_miss_within_the_deadline(tmp_path: Path, seaweed: SeaweedS3, fault: str) -> None:
    url = seaweed.url("kvstore-mp", f"outage-{fault}", connect_timeout=1, read_timeout=1, max_attempts=1)
    spec = kvstore_adapter([url], timeout_s=TIMEOUT_S)
    with MPServer(
        [spec], chunk_size=CHUNK, l1_size_gb=0.2, env=seaweed.env(), log_path=tmp_path / "server.log"
    ) as server:
        if fault == "sigstop":
            _outage(server, lambda: seaweed._signal(signal.SIGSTOP), lambda: seaweed._signal(signal.SIGCONT))
        else:
            _outage(server, seaweed.kill, seaweed.restart)


def _restart_reuse(server: MPServer) -> None:
    toks = tokens(2 * CHUNK, seed=7)
    kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=7)
    with client(server) as c:
        assert c.store(toks, kv) == 2 * CHUNK
        assert c.wait_stored(toks, timeout=60)
    server.kill()
    server.start()
    with client(server) as c:
        hit, got = c.retrieve(toks)
        assert hit == 2 * CHUNK, "a server restarted after kill -9 finds what it stored"
        assert bytes_equal(got, kv)


@needs(redis_available(), "redis-server", REDIS_INSTALL)
def test_redis_tier_survives_a_server_kill(tmp_path: Path) -> None:
    with RedisServer(workdir=tmp_path / "redis") as redis:
        spec = kvstore_adapter([redis.url])
        with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=tmp_path / "server.log") as server:
            _restart_reuse(server)


def test_s3_tier_survives_a_server_kill(tmp_path: Path, seaweed: SeaweedS3) -> None:
    spec = kvstore_adapter([seaweed.url("kvstore-mp", "restart")])
    with MPServer(
        [spec], chunk_size=CHUNK, l1_size_gb=0.2, env=seaweed.env(), log_path=tmp_path / "server.log"
    ) as server:
        _restart_reuse(server)


def test_lmcache_l2_eviction_works_over_the_adapter(tmp_path: Path) -> None:
    """LMCache's own L2 eviction (the adapter JSON's "eviction" key) reads the adapter's
    capacity and usage and deletes through it: the files go from the disk tier."""
    disk = tmp_path / "disk"
    spec = kvstore_adapter([f"file://{disk}?capacity=64MiB&fsync=false"])
    spec["eviction"] = {"eviction_policy": "LRU", "trigger_watermark": 0.3, "eviction_ratio": 0.5}
    with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=tmp_path / "server.log") as server:
        toks = tokens(8 * CHUNK, seed=9)
        kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=9)
        with client(server) as c:
            assert c.store(toks, kv) == 8 * CHUNK  # 8 x 5.9 MB: past 0.3 x 64 MiB
            deadline = time.monotonic() + 60

            def files() -> int:
                return sum(1 for p in (disk / "objects").rglob("*") if p.is_file())

            while files() < 8 and time.monotonic() < deadline and not c.wait_stored(timeout=1):
                pass
            while files() >= 8 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert files() < 8, "LMCache's eviction deleted chunks through the adapter"


def test_a_full_bounded_tier_still_stores_each_new_prompt_whole(tmp_path: Path) -> None:
    """A disk tier bounded at ~10 chunks under the default policy, prompts of 4 fresh
    chunks stored one after another: once the tier is full each store task still
    succeeds (older prompts make room, never the task's own chunks), so with L1 cleared
    the newest prompt is a full hit, and the server logs no failed store task."""
    disk = tmp_path / "disk"
    log = tmp_path / "server.log"
    spec = kvstore_adapter([f"file://{disk}?capacity=64MiB&fsync=false"])
    with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=log) as server, client(server) as c:
        for p in range(5):
            toks = tokens(4 * CHUNK, seed=100 + p)
            kv = random_kv(len(toks), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=100 + p)
            assert c.store(toks, kv) == 4 * CHUNK
            assert c.wait_stored(toks, timeout=60), f"prompt {p} not stored"
            c.clear_l1()
            hit, got = c.retrieve(toks)
            assert hit == 4 * CHUNK, f"prompt {p}: {hit // CHUNK} of 4 chunks served from the full tier"
            assert bytes_equal(got, kv[:, :, :hit])
    assert "failed for keys" not in log.read_text()


def test_back_to_back_prompts_into_a_full_tier_all_store(tmp_path: Path) -> None:
    """Three prompts of 4 fresh chunks stored back to back (their L2 store tasks run at
    the same time) into a disk tier with room for ~11 chunks: no store task fails (none
    makes room with another's chunks before they land), and the newest prompt is a full
    hit with L1 cleared (which older chunk made room is the policy's choice)."""
    disk = tmp_path / "disk"
    log = tmp_path / "server.log"
    spec = kvstore_adapter([f"file://{disk}?capacity=64MiB&fsync=false"])
    prompts = [tokens(4 * CHUNK, seed=200 + p) for p in range(3)]
    kvs = [random_kv(4 * CHUNK, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=200 + p) for p in range(3)]
    with MPServer([spec], chunk_size=CHUNK, l1_size_gb=0.2, log_path=log) as server, client(server) as c:
        for toks, kv in zip(prompts, kvs):
            assert c.store(toks, kv) == 4 * CHUNK
        assert c.wait_stored(timeout=60)
        c.clear_l1()
        hit, got = c.retrieve(prompts[2])
        assert hit == 4 * CHUNK, f"the newest prompt: {hit // CHUNK} of 4 chunks"
        assert bytes_equal(got, kvs[2][:, :, :hit])
    assert "failed for keys" not in log.read_text()
