"""How close the in-process storage plugin's disk reads come to the floor, in one engine.

One LMCache engine (CPU, ``LMCACHE_LOCAL_CPU=False``) with kvstore's storage plugin over
one ``file://`` tier stores one prompt of --chunks chunks; then, in interleaved rounds,
the same chunks are read into the same MemoryObjs (LMCache's allocator) four ways:

    readinto            what LMCache's LocalDiskBackend does for a batch: each chunk's
                        file read whole with ``readinto`` on a pool of 4 threads (its
                        ``disk_io_threads`` default); no check (the unverified floor)
    pread+crc           the same pool, each file read with ``kvstore.checksum.pread_crc32c``
                        (256 KiB blocks, CRC32C over each as it lands)
    mapped+crc          the same pool, each file copied through a read-only mapping with
                        ``kvstore.checksum.mapped_crc32c`` (checksummed in the same pass,
                        streaming stores): the least the disk tier's verified read does
    plugin              ``KVStoreStoragePlugin.batched_get_blocking``: the whole path
                        (keys -> names, the store's loop, the disk tier's streamed read,
                        frame header, key and CRC32C checks, MemoryObjs allocated)

The files are kvstore's own frames, so the floors read a few hundred header bytes more
than the payload; every row reads page-cache-warm bytes into the same buffers.  Prints
wall ms per batch (min / median / max), CPU ms per batch (all threads), and each median
as a fraction of ``readinto``'s.

Usage: python benchmarks/bench_plugin_floor.py [--chunks 8] [--rounds 60] [--options fsync=false]
       [--switch-interval SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402

from kvstore import checksum  # noqa: E402
from kvstore.demo.cpu_engine import build_cpu_engine  # noqa: E402
from kvstore.lmcache_paths import inprocess_module  # noqa: E402

LAYERS, HEADS, HEAD_DIM, CHUNK = 16, 8, 128, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run (Python default 0.005 s)"
    )
    ap.add_argument("--options", default="fsync=false", help="URL options of the file:// tier")
    ap.add_argument("--tmp", default=None, help="directory for the disk tier (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    tmp = Path(tempfile.mkdtemp(dir=args.tmp))
    os.environ.update(
        {
            "LMCACHE_CHUNK_SIZE": str(CHUNK),
            "LMCACHE_LOCAL_CPU": "False",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.0",
            "LMCACHE_BLOCKING_TIMEOUT_SECS": "60",
            "LMCACHE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_EXTRA_CONFIG": json.dumps(
                {
                    "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
                    "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
                    "kvstore.tiers": [f"file://{tmp / 'disk'}?{args.options}"],
                    "kvstore.timeout_s": 30,
                }
            ),
        }
    )
    eng = build_cpu_engine(
        model_name="bench-model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16
    )
    MockGPUConnector = inprocess_module("gpu_connector.mock_gpu_connector").MockGPUConnector
    eng.engine.gpu_connector = MockGPUConnector((LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    ntok = args.chunks * CHUNK
    g = torch.Generator().manual_seed(0)
    kv = [
        tuple(torch.randn(1, HEADS, ntok, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
        for _ in range(LAYERS)
    ]
    tokens = torch.arange(ntok)
    eng.engine.store(tokens, kvcaches=kv)
    eng.wait_for_writes(120)
    plugin = next(b for b in eng.engine.storage_manager.storage_backends.values() if "KVStore" in type(b).__name__)
    keys = [k for _, _, k in eng.engine.token_database.process_tokens(tokens)]
    objs = plugin.batched_get_blocking(keys)
    if any(o is None for o in objs):
        raise SystemExit("the plugin did not find the chunks it stored")
    backend = plugin.runtime.store.tiers[0].backend
    paths = [str(backend.path_of(n)) for n in plugin.bridge.names(keys)]
    sizes = [os.path.getsize(p) for p in paths]
    # the floors read each whole file into a MemoryObj's bytes (the frame is a few hundred
    # bytes longer than the payload: read the payload's length, from the file's start)
    views = [o.byte_array for o in objs]
    lengths = [min(len(v), s) for v, s in zip(views, sizes)]
    pool = ThreadPoolExecutor(4)

    def readinto(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(views[i][: lengths[i]])

    def pread_crc(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            checksum.pread_crc32c(fd, views[i][: lengths[i]], 0)
        finally:
            os.close(fd)

    def mapped_crc(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            if checksum.mapped_crc32c(fd, views[i][: lengths[i]], 0) is None:
                checksum.pread_crc32c(fd, views[i][: lengths[i]], 0)
        finally:
            os.close(fd)

    def plugin_read() -> None:
        got = plugin.batched_get_blocking(keys)
        if any(o is None for o in got):
            raise RuntimeError("plugin read missed")
        for o in got:
            o.ref_count_down()

    cases = [
        ("readinto", lambda: list(pool.map(readinto, range(len(paths))))),
        ("pread+crc", lambda: list(pool.map(pread_crc, range(len(paths))))),
        ("mapped+crc", lambda: list(pool.map(mapped_crc, range(len(paths))))),
        ("plugin", plugin_read),
    ]
    res: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in cases}
    for r in range(args.rounds + 3):
        for name, fn in cases[r % len(cases) :] + cases[: r % len(cases)]:
            t, c = time.perf_counter(), time.process_time()
            fn()
            if r >= 3:  # the first rounds warm up
                res[name].append((time.perf_counter() - t, time.process_time() - c))
    nbytes = sum(lengths)
    kernel = "vpclmulqdq kernels" if checksum.fast() else "the crc32c package"
    print(
        f"{len(paths)} chunks of {nbytes / len(paths) / 2**20:.1f} MiB, {args.rounds} interleaved rounds;"
        f" CRC32C by {kernel}"
    )
    print("| read | wall ms min / median / max | GB/s (median) | CPU ms (median) | x readinto |")
    print("|---|---|---:|---:|---:|")
    base = median(w for w, _ in res["readinto"])
    for name, xs in res.items():
        walls = [w for w, _ in xs]
        m = median(walls)
        print(
            f"| {name} | {min(walls) * 1e3:.1f} / {m * 1e3:.1f} / {max(walls) * 1e3:.1f} | {nbytes / m / 1e9:.2f}"
            f" | {median(c for _, c in xs) * 1e3:.1f} | {base / m:.2f} |"
        )


if __name__ == "__main__":
    code = 1
    try:
        main()
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # LMCache's engine leaves non-daemon threads behind
