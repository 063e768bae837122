"""Store and retrieve throughput through the real LMCache engine: kvstore vs LMCache's own.

Every configuration runs the same workload in the same process, one after another:
prompts of ``--chunks`` chunks are stored through ``engine.store`` (timed until the
backend has finished writing) and read back through ``engine.lookup`` +
``engine.retrieve`` into preallocated KV buffers (timed to the last byte in place).
LMCache's own CPU cache is off in every configuration but ``lmcache-cpu+disk``
(``LMCACHE_LOCAL_CPU=False``), so every byte goes through the backend under test.

Configurations:

* ``lmcache-disk``   LMCache's LocalDiskBackend (``LMCACHE_LOCAL_DISK``) — the baseline;
* ``kvstore-disk``   kvstore storage plugin, one ``file://`` tier;
* ``kvstore-disk-pread``  the same, its copies by ``pread`` (``mmap=false``) instead of through a mapping;
* ``kvstore-disk-remote``  the same tier through the remote-connector path;
* ``lmcache-fs``     LMCache's ``fs://`` remote connector (a file per chunk, naive serde);
* ``lmcache-rawblock`` / ``lmcache-rawblock-uring``  LMCache's rust raw-block storage
  plugin (``posix`` / ``io_uring`` engine) on an 8 GiB sparse file standing in for a block
  device, page cache on (its default), when the ``lmcache_rust_raw_block_io`` wheel is
  installed;
* ``lmcache-redis``  LMCache's Redis connector on a local ``redis-server`` (if installed);
* ``lmcache-resp``   LMCache's ``resp://`` connector (its C++ RESP client, 8 threads) on the
  same server, where this LMCache build has it;
* ``kvstore-redis``  kvstore storage plugin, one ``redis://`` tier on the same server (db 1);
* ``lmcache-cpu+disk``  LMCache's CPU pool (``LMCACHE_LOCAL_CPU=True``, 4 GB) in front of
  LocalDisk: the peer of
* ``kvstore-mem+disk``  kvstore with a memory tier (``mem://?capacity=4GiB&preallocate=true``,
  touched at start as LMCache's CPU pool is) over the disk
  tier;
* with ``--s3``: ``lmcache-s3`` (LMCache's S3 connector, awscrt) and ``kvstore-s3`` (the
  storage plugin, one ``s3://`` tier) against one SeaweedFS (``weed mini``) on loopback.
  LMCache's connector addresses a bucket by virtual host only (``Host: BUCKET.HOST``),
  so the S3 server runs with ``-s3.domainName=localhost`` and ``kvbench.localhost`` must
  resolve to 127.0.0.1 (a line ``127.0.0.1 kvbench.localhost`` in /etc/hosts); without
  it only ``kvstore-s3`` runs.

With ``--interleave`` every configuration's engine is built first and the rounds run
interleaved (the order rotates each round); ratios are then per round, min / median /
max.

Usage: ``python benchmarks/bench_lmcache.py [--chunks 8] [--rounds 5] [--interleave] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402

from kvstore.backends.memory_arena import available_memory  # noqa: E402
from kvstore.demo.cpu_engine import build_cpu_engine  # noqa: E402
from kvstore.demo.hf_connector import empty_kv  # noqa: E402
from kvstore.lmcache_paths import inprocess_module  # noqa: E402
from kvstore.options import parse_size  # noqa: E402

PLUGIN = {
    "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
    "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
}
REMOTE = {
    "remote_storage_plugin.kvstore.module_path": "kvstore_lmcache.remote_connector",
    "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server():
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


S3_BUCKET = "kvbench"


@contextlib.contextmanager
def s3_server(enabled: bool):
    if not enabled:
        yield None
        return
    from kvstore.testing.seaweed import SeaweedS3

    s3 = SeaweedS3(extra_args=("-s3.domainName=localhost",)).start()
    try:
        s3.create_bucket(S3_BUCKET)
        yield s3
    finally:
        s3.stop()


def s3_configs(base: dict[str, str], s3, options: str = "") -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    try:
        socket.getaddrinfo(f"{S3_BUCKET}.localhost", s3.ports.s3)
    except OSError:
        print(
            f"  (lmcache-s3 skipped: {S3_BUCKET}.localhost does not resolve; see the docstring)", flush=True
        )
    else:
        out["lmcache-s3"] = {
            **base,
            "LMCACHE_REMOTE_URL": f"s3://{S3_BUCKET}.localhost:{s3.ports.s3}",
            "LMCACHE_REMOTE_SERDE": "naive",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {
                    "s3_num_io_threads": 8,
                    "s3_prefer_http2": False,
                    "s3_region": "us-east-1",
                    "disable_tls": True,
                    "aws_access_key_id": s3.access_key,
                    "aws_secret_access_key": s3.secret_key,
                }
            ),
        }
    out["kvstore-s3"] = {
        **base,
        "LMCACHE_STORAGE_PLUGINS": "kvstore",
        "LMCACHE_EXTRA_CONFIG": json.dumps(
            {
                **PLUGIN,
                "kvstore.tiers": [s3.url(S3_BUCKET, "kvbench") + (f"&{options}" if options else "")],
                "kvstore.timeout_s": 30,
            }
        ),
    }
    return out


def resp_client_available() -> bool:
    """Whether this LMCache build has its native RESP client (``resp://`` URLs)."""
    try:
        from lmcache.v1.storage_backend.native_clients.resp_client import REDIS_AVAILABLE
    except ImportError:
        return False
    return bool(REDIS_AVAILABLE)


RAW_BLOCK_BYTES = 8 << 30  # the raw-block file: a sparse file of this size


def raw_block_file(path: Path, size: int) -> Path:
    """A sparse file for LMCache's raw-block backend to use as its device."""
    if not path.exists():
        with open(path, "wb") as f:
            f.truncate(size)
    return path


def configs(tmp: Path, redis_url: str | None, s3=None, s3_options: str = "") -> dict[str, dict[str, str]]:
    base = {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.0",
        "LMCACHE_BLOCKING_TIMEOUT_SECS": "60",
        "LMCACHE_LOG_LEVEL": "ERROR",
    }
    out = {
        "lmcache-disk": {
            **base,
            "LMCACHE_LOCAL_DISK": f"file://{tmp / 'lmcache-disk'}/",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": "20",
        },
        "kvstore-disk": {
            **base,
            "LMCACHE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {
                    **PLUGIN,
                    "kvstore.tiers": [f"file://{tmp / 'kv-disk'}?fsync=false"],
                    "kvstore.timeout_s": 30,
                }
            ),
        },
        "kvstore-disk-pread": {  # the same with copies by pread instead of through a mapping
            **base,
            "LMCACHE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {
                    **PLUGIN,
                    "kvstore.tiers": [f"file://{tmp / 'kv-disk-p'}?fsync=false&mmap=false"],
                    "kvstore.timeout_s": 30,
                }
            ),
        },
        "kvstore-disk-remote": {
            **base,
            "LMCACHE_REMOTE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_REMOTE_SERDE": "naive",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {
                    **REMOTE,
                    "kvstore.tiers": [f"file://{tmp / 'kv-disk-r'}?fsync=false"],
                    "kvstore.timeout_s": 30,
                }
            ),
        },
    }
    # LMCache's other file backends: its `fs` remote connector, and (when the
    # `lmcache_rust_raw_block_io` wheel is installed) its rust raw-block storage plugin
    # on a preallocated file standing in for a block device; page cache, as the others
    out["lmcache-fs"] = {
        **base,
        "LMCACHE_REMOTE_URL": f"fs://localhost:0{tmp / 'lmcache-fs'}",
        "LMCACHE_REMOTE_SERDE": "naive",
    }
    if importlib.util.find_spec("lmcache_rust_raw_block_io") is not None:
        for name, engine in (("lmcache-rawblock", "posix"), ("lmcache-rawblock-uring", "io_uring")):
            out[name] = {
                **base,
                "LMCACHE_STORAGE_PLUGINS": "rust_raw_block",
                "LMCACHE_EXTRA_CONFIG": json.dumps(
                    {
                        "storage_plugin.rust_raw_block.module_path": "lmcache.v1.storage_backend.plugins.rust_raw_block_backend",
                        "storage_plugin.rust_raw_block.class_name": "RustRawBlockBackend",
                        "rust_raw_block.device_path": str(raw_block_file(tmp / f"{name}.img", RAW_BLOCK_BYTES)),
                        "rust_raw_block.capacity_bytes": RAW_BLOCK_BYTES,
                        "rust_raw_block.io_engine": engine,
                        "rust_raw_block.meta_enable_periodic": False,
                    }
                ),
            }
    if redis_url:
        out["lmcache-redis"] = {**base, "LMCACHE_REMOTE_URL": redis_url, "LMCACHE_REMOTE_SERDE": "naive"}
        if resp_client_available():  # LMCache's C++ RESP client (8 threads): its fastest Redis path
            out["lmcache-resp"] = {
                **base,
                "LMCACHE_REMOTE_URL": "resp://" + redis_url.removeprefix("redis://"),
                "LMCACHE_REMOTE_SERDE": "naive",
            }
        out["kvstore-redis"] = {
            **base,
            "LMCACHE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {**PLUGIN, "kvstore.tiers": [f"{redis_url}/1"], "kvstore.timeout_s": 30}
            ),
        }
    if s3 is not None:
        out.update(s3_configs(base, s3, s3_options))
    # the peer of kvstore's memory + disk tiers: LMCache's CPU pool in front of LocalDisk
    out["lmcache-cpu+disk"] = {
        **base,
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "4.0",
        "LMCACHE_LOCAL_DISK": f"file://{tmp / 'lmcache-disk2'}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "20",
    }
    out["kvstore-mem+disk"] = {
        **base,
        "LMCACHE_STORAGE_PLUGINS": "kvstore",
        "LMCACHE_EXTRA_CONFIG": json.dumps(
            {
                **PLUGIN,
                "kvstore.tiers": [
                    "mem://bench-hot?capacity=4GiB&preallocate=true",
                    f"file://{tmp / 'kv-disk2'}?fsync=false",
                ],
                "kvstore.timeout_s": 30,
            }
        ),
    }
    return out


class Runner:
    """One configuration's engine and its timed rounds (a round stores a fresh prompt,
    then looks it up and retrieves it; round 0 warms up and checks the bytes)."""

    def __init__(self, name: str, env: dict[str, str], args, kv) -> None:
        self.name, self.args, self.kv = name, args, kv
        saved = {k: v for k, v in os.environ.items() if k.startswith("LMCACHE_")}
        for k in saved:
            del os.environ[k]
        os.environ.update(env)
        try:
            self.eng = build_cpu_engine(
                model_name="bench-model",
                num_layers=args.layers,
                num_kv_heads=args.heads,
                head_dim=args.head_dim,
                dtype=torch.bfloat16,
            )
        finally:
            for k in [k for k in os.environ if k.startswith("LMCACHE_")]:
                del os.environ[k]
            os.environ.update(saved)
        if args.connector == "none":
            # LMCache's MockGPUConnector copies nothing: what is left is the storage path alone
            MockGPUConnector = inprocess_module("gpu_connector.mock_gpu_connector").MockGPUConnector
            self.eng.engine.gpu_connector = MockGPUConnector((args.layers, 2, 256, args.heads, args.head_dim))
        self.ntok = args.chunks * 256
        self.nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        self.out_kv = empty_kv(args.layers, args.heads, self.ntok, args.head_dim, torch.bfloat16)
        self.store_s: list[float] = []
        self.load_s: list[float] = []
        self.hits: list[int] = []

    def round(self, r: int) -> None:
        eng, ntok = self.eng.engine, self.ntok
        tokens = torch.arange(r * 1_000_000, r * 1_000_000 + ntok)
        t = time.perf_counter()
        eng.store(tokens, kvcaches=self.kv)
        self.eng.wait_for_writes(120)
        # LMCache's connectors do not report when a write ends: stored = found by lookup
        deadline = time.monotonic() + 60
        while eng.lookup(tokens) < ntok and time.monotonic() < deadline:
            time.sleep(0.001)
        st = time.perf_counter() - t
        t = time.perf_counter()
        hit = eng.lookup(tokens)
        got = int(eng.retrieve(tokens, kvcaches=self.out_kv, req_id=f"r{r}").sum()) if hit else 0
        lt = time.perf_counter() - t
        if r == 0:
            if got != ntok or (
                self.args.connector != "none" and not torch.equal(self.out_kv[0][0], self.kv[0][0])
            ):
                raise RuntimeError(f"{self.name}: retrieve returned {got}/{ntok} tokens or wrong bytes")
            return
        self.store_s.append(st)
        self.load_s.append(lt)
        self.hits.append(got)

    def close(self) -> None:
        # LMCache 0.5.6's Redis connector deadlocks in close() (its executor shutdown waits
        # on the event loop it runs on): close in a helper thread and move on after 10 s
        closer = threading.Thread(target=self.eng.close, daemon=True)
        closer.start()
        closer.join(10)
        if closer.is_alive():
            print(f"  ({self.name}: engine close() hung; left behind)", flush=True)

    def result(self) -> dict:
        return {
            "config": self.name,
            "bytes_per_prompt": self.nbytes,
            "store_GBps": self.nbytes / statistics.median(self.store_s) / 1e9,
            "retrieve_GBps": self.nbytes / statistics.median(self.load_s) / 1e9,
            "store_s_median": statistics.median(self.store_s),
            "retrieve_s_median": statistics.median(self.load_s),
            "store_s": self.store_s,
            "retrieve_s": self.load_s,
            "tokens_hit": self.hits,
        }


def run_config(name: str, env: dict[str, str], args, kv) -> dict:
    runner = Runner(name, env, args, kv)
    try:
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            runner.round(r)
    finally:
        runner.close()
    return runner.result()


def run_interleaved(envs: dict[str, dict[str, str]], args, kv) -> list[dict]:
    """Every configuration's engine at once; each round runs them all, in an order that
    rotates every round, so drift in the machine's speed falls on all of them alike."""
    runners = [Runner(name, env, args, kv) for name, env in envs.items()]
    try:
        for r in range(args.rounds + 1):
            k = r % len(runners)
            for runner in runners[k:] + runners[:k]:
                runner.round(r)
    finally:
        for runner in runners:
            runner.close()
    return [runner.result() for runner in runners]


def memory_needed(envs: dict[str, dict[str, str]]) -> int:
    """Bytes the engines of `envs` hold at once: LMCache's CPU pool of each (the plugins
    allocate their reads from it) and kvstore's preallocated memory tiers."""
    total = 0
    for env in envs.values():
        total += int(float(env.get("LMCACHE_MAX_LOCAL_CPU_SIZE", "0")) * (1 << 30))
        for url in json.loads(env.get("LMCACHE_EXTRA_CONFIG", "{}")).get("kvstore.tiers", []):
            if url.startswith("mem://") and "preallocate=true" in url:
                total += parse_size(parse_qs(urlsplit(url).query)["capacity"][0]) or 0
    return total


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 tokens per prompt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--connector",
        choices=["contiguous", "none"],
        default="contiguous",
        help="contiguous: copy to/from HF-layout KV tensors; none: no KV copies (storage path only)",
    )
    ap.add_argument(
        "--s3", action="store_true", help="also LMCache's S3 connector vs kvstore's S3 tier (SeaweedFS)"
    )
    ap.add_argument(
        "--s3-options", default="", help="URL options of kvstore's s3:// tier, e.g. range_threshold=1GiB"
    )
    ap.add_argument("--only", nargs="*", help="run only these configurations")
    ap.add_argument("--tmp", default=None, help="directory for the disk tiers (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="build every configuration's engine first and run their rounds interleaved"
        " (ratios per round, min / median / max)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    ntok = args.chunks * 256
    g = torch.Generator().manual_seed(0)
    kv = [
        (
            torch.randn(1, args.heads, ntok, args.head_dim, generator=g).to(torch.bfloat16),
            torch.randn(1, args.heads, ntok, args.head_dim, generator=g).to(torch.bfloat16),
        )
        for _ in range(args.layers)
    ]
    results = []
    with (
        tempfile.TemporaryDirectory(dir=args.tmp) as d,
        redis_server() as redis_url,
        s3_server(args.s3) as s3,
        s3.credentials_env() if s3 is not None else contextlib.nullcontext(),
    ):
        envs = {
            name: env
            for name, env in configs(Path(d), redis_url, s3, args.s3_options).items()
            if not args.only or name in args.only
        }
        for name in sorted(set(args.only or ()) - set(envs)):
            why = "pip install lmcache_rust_raw_block_io" if name.startswith("lmcache-rawblock") else "see --help"
            print(f"({name}: not available here: {why})", flush=True)
        if args.interleave:
            need, have = memory_needed(envs), available_memory()
            if have is not None and need + (2 << 30) > have:
                sys.exit(
                    f"--interleave builds all {len(envs)} engines at once: their memory pools take"
                    f" {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB is available (2 GiB kept for the"
                    " rest); pick fewer with --only, or run without --interleave"
                )
            results = run_interleaved(envs, args, kv)
        else:
            results = [run_config(name, env, args, kv) for name, env in envs.items()]
        for res in results:
            print(
                f"{res['config']:22s} store {res['store_GBps']:6.2f} GB/s   retrieve {res['retrieve_GBps']:6.2f} GB/s"
                f"   ({res['bytes_per_prompt'] / 2**20:.0f} MiB per prompt)",
                flush=True,
            )
    by_name = {r["config"]: r for r in results}
    base = by_name.get("lmcache-disk")
    if base and args.interleave:
        print("\nratios vs lmcache-disk per round (LMCache's time / this one's), min / median / max:")
        for r in results:
            st = [b / x for b, x in zip(base["store_s"], r["store_s"])]
            rt = [b / x for b, x in zip(base["retrieve_s"], r["retrieve_s"])]
            print(f"{r['config']:22s} store x {spread(st)}   retrieve x {spread(rt)}")
    elif base:
        print("\nratios vs lmcache-disk (same run):")
        for r in results:
            print(
                f"{r['config']:22s} store x{r['store_GBps'] / base['store_GBps']:.2f}"
                f"   retrieve x{r['retrieve_GBps'] / base['retrieve_GBps']:.2f}"
            )
    peers = [
        ("kvstore-redis", "lmcache-redis"),
        ("kvstore-redis", "lmcache-resp"),
        ("kvstore-s3", "lmcache-s3"),
        ("kvstore-mem+disk", "lmcache-cpu+disk"),
        ("kvstore-disk", "lmcache-fs"),
        ("kvstore-disk", "lmcache-rawblock"),
        ("kvstore-disk", "lmcache-rawblock-uring"),
    ]
    peers = [(k, lm) for k, lm in peers if k in by_name and lm in by_name]
    if peers:
        print("\nratios vs LMCache's connector of the same kind (same run):")
        for k, lm in peers:
            a, b = by_name[k], by_name[lm]
            if args.interleave:
                st = [y / x for x, y in zip(a["store_s"], b["store_s"])]
                rt = [y / x for x, y in zip(a["retrieve_s"], b["retrieve_s"])]
                print(f"{k + ' / ' + lm:30s} store x {spread(st)}   retrieve x {spread(rt)}  (per round)")
                continue
            print(
                f"{k + ' / ' + lm:30s} store x{a['store_GBps'] / b['store_GBps']:.2f}"
                f"   retrieve x{a['retrieve_GBps'] / b['retrieve_GBps']:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    sys.stdout.flush()
    os._exit(0)  # a hung LMCache close leaves non-daemon threads behind


if __name__ == "__main__":
    main()
