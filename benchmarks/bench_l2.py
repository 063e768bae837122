"""MP mode: kvstore's L2 adapter against LMCache's own L2 adapters of the same kind.

Every adapter is driven the way LMCache's MP server drives it (`kvstore_lmcache.l2_sync.SyncL2`:
submit a store / lookup / load task, wait on its event fd), in one process, on the same
chunks, in interleaved rounds (the order rotates each round):

* disk:  kvstore ``file://`` (frames, CRC32C checked on load)  vs LMCache ``fs``; add
  ``fs_native`` to ``--kinds`` (``disk,fs_native``) for LMCache's C++ fs connector, and
  ``raw_block`` for its raw-block adapter on a sparse file standing in for a device,
  through the page cache and with O_DIRECT (its default)
* redis: kvstore ``redis://``                                   vs LMCache ``resp``
* s3:    kvstore ``s3://``                                      vs LMCache ``s3`` (awscrt)

For ``s3`` both adapters talk to one SeaweedFS (``weed mini``) on loopback that the
benchmark starts, bucket ``kvbench``, emptied before every round.  LMCache's ``s3``
adapter addresses a bucket by virtual host only (``Host: BUCKET.HOST``), so the S3 server
runs with ``-s3.domainName=localhost`` and ``kvbench.localhost`` must resolve to
127.0.0.1 (a line ``127.0.0.1 kvbench.localhost`` in /etc/hosts); without it only
``kvstore-s3`` runs (and no ratio is printed).  kvstore takes the server's credentials
from the AWS environment variables, LMCache's adapter from its config's static keys.

A round stores N fresh chunks in store tasks of `--batch` chunks (timed until every task
has completed), then looks them up and loads them into preallocated buffers (timed
from lookup to the last load; page-cache-warm for disk).  Before each round's timed
tasks the script collects garbage and calls ``os.sync()`` (outside the clock, for every
adapter alike), so no adapter pays for another's construction or earlier writes.  The
first round checks that the bytes loaded are the bytes stored.  Printed: GB/s per adapter, and per pair the
kvstore / LMCache ratio of each round as min / median / max.

Usage:
    python benchmarks/bench_l2.py                               # 32 layers x 8 heads x 128, bf16
    python benchmarks/bench_l2.py --shape smollm2 --rounds 7
    python benchmarks/bench_l2.py --kinds disk --chunks 16
    python benchmarks/bench_l2.py --kinds s3 [--s3-opts concurrency=32]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

SHAPES = {
    # [2 (K, V), layers, tokens per chunk, kv_heads * head_dim], the MP server's chunk object
    "llama8b": (2, 32, 256, 8 * 128),
    "smollm2": (2, 30, 256, 3 * 64),
}
GB = 1e9
S3_BUCKET = "kvbench"  # LMCache's s3 adapter reaches it as kvbench.localhost (see the docstring)


@dataclass
class Config:
    name: str
    kind: str
    make: Callable[[], object]
    reset: Callable[[], None]
    store_gbs: list[float] = field(default_factory=list)
    load_gbs: list[float] = field(default_factory=list)


def build_adapter(spec: dict) -> object:
    """An adapter from its ``--l2-adapter`` JSON, through LMCache's own parser and factory."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    return create_l2_adapter(cfg.adapters[0])


def kvstore_spec(tiers: list[str]) -> dict:
    return {
        "type": "plugin",
        "module_path": "kvstore_lmcache.l2_adapter",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"tiers": tiers, "timeout_s": 30},
    }


def start_s3(stack: contextlib.ExitStack) -> tuple[Any, Callable[[], None]]:
    """A SeaweedFS on loopback (virtual-host addressing for LMCache's adapter) with bucket
    `S3_BUCKET`, the AWS variables set for kvstore's tier, and a function that empties the
    bucket; `stack` tears them down."""
    import boto3

    from kvstore.testing.seaweed import SeaweedS3

    s3 = SeaweedS3(extra_args=("-s3.domainName=localhost",)).start()
    stack.callback(s3.stop)
    s3.create_bucket(S3_BUCKET)
    stack.enter_context(s3.credentials_env())  # kvstore's tier reads the standard AWS variables
    client = boto3.client("s3", **s3.client_kwargs())
    stack.callback(client.close)

    def empty_bucket() -> None:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=S3_BUCKET, Key=obj["Key"])

    return s3, empty_bucket


def lmcache_s3_spec(s3: Any) -> dict | None:
    """LMCache's ``s3`` adapter on that server, or None (said why) when its virtual host
    ``kvbench.localhost`` does not resolve (see the docstring)."""
    try:
        socket.getaddrinfo(f"{S3_BUCKET}.localhost", s3.ports.s3)
    except OSError:
        print(f"  (lmcache-s3 skipped: {S3_BUCKET}.localhost does not resolve; see the docstring)", flush=True)
        return None
    return {
        "type": "s3",
        "s3_endpoint": f"s3://{S3_BUCKET}.localhost:{s3.ports.s3}",
        "s3_region": s3.region,
        "s3_num_io_threads": 8,
        "s3_prefer_http2": False,
        "disable_tls": True,
        "aws_access_key_id": s3.access_key,
        "aws_secret_access_key": s3.secret_key,
    }


def run_round(cfg: Config, data: list[torch.Tensor], dst: list[torch.Tensor], batch: int, base: int, check: bool):
    from kvstore_lmcache.l2_sync import SyncL2, object_key

    cfg.reset()
    adapter = cfg.make()
    # A server builds its adapter once; here each round builds a fresh one, and the
    # garbage collector's debt for that (a full collection: 100-200 ms in a process
    # holding torch and LMCache) must not land in whichever adapter's timed phase comes
    # next.  Collections the timed tasks cause themselves still count.
    gc.collect()
    os.sync()  # the earlier rounds' dirty pages written back now, not during this round's stores
    try:
        l2 = SyncL2(adapter, timeout_s=300)
        keys = [object_key(base + i) for i in range(len(data))]
        nbytes = sum(t.nbytes for t in data)
        t0 = time.perf_counter()
        for s in range(0, len(keys), batch):
            assert l2.store(keys[s : s + batch], data[s : s + batch]), f"{cfg.name}: store failed"
        t1 = time.perf_counter()
        for d in dst:
            d.zero_()
        t2 = time.perf_counter()
        hits = l2.lookup(keys)
        assert all(hits), f"{cfg.name}: lookup found {sum(hits)} of {len(keys)}"
        for s in range(0, len(keys), batch):
            got = l2.load(keys[s : s + batch], dst[s : s + batch])
            assert all(got), f"{cfg.name}: load found {sum(got)} of {len(got)}"
        t3 = time.perf_counter()
        l2.unlock(keys)
        if check:
            for a, b in zip(data, dst):
                assert torch.equal(a, b), f"{cfg.name}: loaded bytes differ"
        cfg.store_gbs.append(nbytes / GB / (t1 - t0))
        cfg.load_gbs.append(nbytes / GB / (t3 - t2))
    finally:
        adapter.close()  # type: ignore[attr-defined]


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {median(xs):.2f} / {max(xs):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="chunks per store / load task")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kinds", default="disk,redis")
    p.add_argument("--redis-opts", default="", help="query options for kvstore's Redis URL, e.g. ?inflight=8")
    p.add_argument("--s3-opts", default="", help="more URL options for kvstore's s3:// tier, e.g. concurrency=32")
    p.add_argument("--dir", default=None, help="where the disk adapters write (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(1)

    shape = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    dst = [torch.empty_like(t) for t in data]
    kinds = args.kinds.split(",")
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-l2-"))
    configs: list[Config] = []
    cleanup: list[Callable[[], None]] = []

    def fresh(d: Path) -> Callable[[], None]:
        def reset() -> None:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)

        return reset

    if "disk" in kinds:
        kd, ld = root / "kvstore", root / "lmcache-fs"
        configs.append(
            Config("kvstore-file", "disk", lambda: build_adapter(kvstore_spec([f"file://{kd}?fsync=false"])), fresh(kd))
        )
        configs.append(Config("lmcache-fs", "disk", lambda: build_adapter({"type": "fs", "base_path": str(ld)}), fresh(ld)))
        if "fs_native" in kinds:  # LMCache's C++ fs connector
            nd = root / "lmcache-fs-native"
            configs.append(
                Config(
                    "lmcache-fs-native",
                    "disk",
                    lambda: build_adapter({"type": "fs_native", "base_path": str(nd)}),
                    fresh(nd),
                )
            )
        if "raw_block" in kinds:  # LMCache's raw-block adapter
            slot = -(-(data[0].nbytes + 4096) // 4096) * 4096  # a chunk and its header, block-aligned
            capacity = max(8 << 30, 2 * slot * args.chunks * (args.rounds + 1) + (256 << 20))
            for name, direct in (("lmcache-rawblock", False), ("lmcache-rawblock-direct", True)):
                img = root / f"{name}.img"
                with open(img, "wb") as f:  # sparse: a stand-in for a block device
                    f.truncate(capacity)
                spec = {
                    "type": "raw_block",
                    "device_path": str(img),
                    "capacity_bytes": capacity,
                    "slot_bytes": slot,
                    "use_odirect": direct,
                    "meta_enable_periodic": False,
                }
                configs.append(Config(name, "disk", lambda spec=spec: build_adapter(spec), lambda: None))
    if "redis" in kinds:
        from kvstore.testing.redis_server import RedisServer

        server = RedisServer(extra=["--maxmemory", "0"]).start()
        cleanup.append(server.close)

        def flush() -> None:
            server.command("FLUSHALL")

        kv_redis = server.url + args.redis_opts

        configs.append(
            Config("kvstore-redis", "redis", lambda: build_adapter(kvstore_spec([kv_redis])), flush)
        )
        configs.append(
            Config(
                "lmcache-resp",
                "redis",
                lambda: build_adapter({"type": "resp", "host": server.host, "port": server.port}),
                flush,
            )
        )
    if "s3" in kinds:
        with contextlib.ExitStack() as stack:  # torn down here if setting up fails, else at the end
            s3, empty_bucket = start_s3(stack)
            cleanup.append(stack.pop_all().close)
        kv_s3 = s3.url(S3_BUCKET, "bench-l2") + (f"&{args.s3_opts.lstrip('?&')}" if args.s3_opts else "")
        configs.append(Config("kvstore-s3", "s3", lambda: build_adapter(kvstore_spec([kv_s3])), empty_bucket))
        lm_s3 = lmcache_s3_spec(s3)
        if lm_s3 is not None:
            print(f"  lmcache-s3 adapter: {json.dumps(lm_s3)}", flush=True)
            configs.append(Config("lmcache-s3", "s3", lambda: build_adapter(lm_s3), empty_bucket))
    try:
        base = 0
        for r in range(args.rounds + 1):  # round 0 warms up and checks bytes
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for cfg in order:
                base += args.chunks
                run_round(cfg, data, dst, args.batch, base, check=r == 0)
                if r == 0:
                    cfg.store_gbs.clear()
                    cfg.load_gbs.clear()
    finally:
        for fn in cleanup:
            fn()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    mib = data[0].nbytes / (1 << 20)
    print(
        f"\n{args.chunks} chunks of {list(shape)} bf16 ({mib:.1f} MiB each), tasks of {args.batch}, "
        f"{args.rounds} rounds; GB/s min / median / max\n"
    )
    print("| adapter | store GB/s | load GB/s |")
    print("|---|---:|---:|")
    for cfg in configs:
        print(f"| {cfg.name} | {spread(cfg.store_gbs)} | {spread(cfg.load_gbs)} |")
    groups = [list(g) for _kind, g in itertools.groupby(configs, key=lambda c: c.kind)]
    pairs = [(g[0], other) for g in groups for other in g[1:]]  # kvstore's first in each kind
    if not pairs:  # LMCache's side skipped (s3 without kvbench.localhost)
        return
    print("\n| kvstore / LMCache (per round) | store | load |")
    print("|---|---:|---:|")
    for ours, theirs in pairs:
        stores = [a / b for a, b in zip(ours.store_gbs, theirs.store_gbs)]
        loads = [a / b for a, b in zip(ours.load_gbs, theirs.load_gbs)]
        print(f"| {ours.name} / {theirs.name} | {spread(stores)} | {spread(loads)} |")


if __name__ == "__main__":
    main()
