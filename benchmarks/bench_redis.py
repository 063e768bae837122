"""Redis tier throughput: kvstore RedisBackend vs plain redis-py SET/GET vs LMCache 0.5.6.

All three run in the same process against the same redis-server, one after another for
each repetition (order rotated), on the same objects sizes and batch sizes:

* kvstore   `RedisBackend.put_many` / `get_many(alloc=...)` into reused buffers.
* redis-py  `kvstore.throughput.baseline_redis.Baseline`: one SET / GET per object, a batch
            as concurrent coroutines, GET copied into a reused buffer.
* LMCache   `lmcache.v1.storage_backend.connector.redis_connector.RedisConnector` (the
            connector LMCache 0.5.6 uses for ``redis://`` remote URLs) called directly
            with CPU MemoryObjs: `batched_put`, and `get` per key gathered per batch.

Usage:
    python benchmarks/bench_redis.py                  # starts its own redis-server
    python benchmarks/bench_redis.py --url redis://127.0.0.1:6379/0 --sizes 1,8,32
Prints a markdown table: median MiB/s over interleaved rounds and the median per-round
ratio kvstore / redis-py (robust to load from other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvstore.backends import open_backend
from kvstore.throughput.baseline_redis import Baseline, plain_client

MiB = 1 << 20


async def timed(coro_factory, nbytes: int) -> float:
    t0 = time.perf_counter()
    await coro_factory()
    return nbytes / MiB / (time.perf_counter() - t0)


class KvstoreRunner:
    name = "kvstore"

    def __init__(self, url: str, size: int, n: int, batch: int, data: memoryview) -> None:
        self.b = open_backend(url)
        self.names = [f"bench/m/vllm-1-0/{i}" for i in range(n)]
        self.batch, self.data = batch, data
        self.bufs = [memoryview(bytearray(size)) for _ in range(batch)]

    async def put(self) -> None:
        for s in range(0, len(self.names), self.batch):
            ok = await self.b.put_many([(n, self.data) for n in self.names[s : s + self.batch]])
            assert all(ok), "kvstore put failed"

    async def get(self) -> None:
        for s in range(0, len(self.names), self.batch):
            slots = iter(self.bufs)
            got = await self.b.get_many(
                self.names[s : s + self.batch], alloc=lambda n, it=slots: next(it)[:n]
            )
            assert all(g is not None for g in got), "kvstore get missed"

    async def get_views(self) -> None:
        """get_many without alloc: views of hiredis's replies, no copy at all."""
        for s in range(0, len(self.names), self.batch):
            got = await self.b.get_many(self.names[s : s + self.batch])
            assert all(g is not None for g in got), "kvstore get missed"

    async def check(self) -> None:
        assert bytes((await self.b.get_many(self.names[:1]))[0]) == bytes(self.data)

    async def close(self) -> None:
        await self.b.close()


class TierRunner:
    """Tensors through `Tier` (raw codec): each object is a frame, header + payload parts."""

    name = "kvstore Tier"

    def __init__(self, url: str, size: int, n: int, batch: int, data: memoryview) -> None:
        from kvstore.tier import Tier

        self.tier = Tier(open_backend(url), "raw")
        self.names = [f"bench/m/vllm-1-0/t{i}" for i in range(n)]
        self.batch = batch
        self.tensor = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
        self.bufs = [memoryview(bytearray(size + 4096)) for _ in range(batch)]

    async def put(self) -> None:
        for s in range(0, len(self.names), self.batch):
            ok = await self.tier.put_many([(n, self.tensor) for n in self.names[s : s + self.batch]])
            assert all(ok), "Tier put failed"

    async def get(self) -> None:
        for s in range(0, len(self.names), self.batch):
            slots = iter(self.bufs)
            got = await self.tier.get_many(
                self.names[s : s + self.batch], alloc=lambda n, it=slots: next(it)[:n]
            )
            assert all(g is not None for g in got), "Tier get missed"

    async def close(self) -> None:
        await self.tier.close()


class RedisPyRunner:
    name = "redis-py"

    def __init__(self, url: str, size: int, n: int, batch: int, data: memoryview) -> None:
        self.base = Baseline()
        self.url, self.n, self.batch, self.data = url, n, batch, data
        self.bufs = [memoryview(bytearray(size)) for _ in range(batch)]

    async def open(self) -> None:
        await self.base.open(self.url)

    async def put(self) -> None:
        for s in range(0, self.n, self.batch):
            await asyncio.gather(
                *(self.base.put(i, self.data) for i in range(s, min(s + self.batch, self.n)))
            )

    async def get(self) -> None:
        for s in range(0, self.n, self.batch):
            idx = range(s, min(s + self.batch, self.n))
            await asyncio.gather(*(self.base.get(i, self.bufs[k]) for k, i in enumerate(idx)))

    async def close(self) -> None:
        await self.base.close()


class LMCacheRunner:
    """LMCache 0.5.6's RedisConnector on CPU MemoryObjs (no engine, no GPU)."""

    name = "LMCache RedisConnector"

    def __init__(self, url: str, size: int, n: int, batch: int, data: memoryview) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        # bf16 KV of `layers` layers x 2 x 256 tokens x 2 heads x 128 = size bytes
        layers = size // (2 * 256 * 2 * 128 * 2)
        assert layers * 2 * 256 * 2 * 128 * 2 == size, "sizes must be multiples of 256 KiB"
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=(batch * 3 * size) / (1 << 30) + 0.1
        )
        md = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(layers, 2, 256, 2, 128),
        )
        self.cpu = LocalCPUBackend(cfg, md)
        self.conn = RedisConnector(url, asyncio.get_running_loop(), self.cpu)
        self.keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(n)]
        self.batch = batch
        self.objs = []
        for _ in range(batch):
            obj = self.cpu.allocate(self.conn.meta_shapes, self.conn.meta_dtypes, self.conn.meta_fmt)
            obj.byte_array.cast("B")[:] = data
            self.objs.append(obj)

    async def put(self) -> None:
        for s in range(0, len(self.keys), self.batch):
            keys = self.keys[s : s + self.batch]
            await self.conn.batched_put(keys, self.objs[: len(keys)])

    async def get(self) -> None:
        for s in range(0, len(self.keys), self.batch):
            got = await asyncio.gather(*(self.conn.get(k) for k in self.keys[s : s + self.batch]))
            assert all(g is not None for g in got), "LMCache get missed"
            for g in got:
                g.ref_count_down()

    async def close(self) -> None:
        for o in self.objs:
            o.ref_count_down()
        # RedisConnector.close() blocks on its executor from inside the loop it runs on
        # (it expects to be called from another thread); close the same parts directly.
        await self.conn.pq_executor.shutdown_async(wait=True)
        await self.conn.connection.aclose()


async def run_size(url: str, size_mib: int, args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    size = size_mib * MiB
    n = max(args.batch, args.total_mib // size_mib)
    nbytes = n * size
    data = memoryview(os.urandom(size))
    kv_url = url + ("&" if "?" in url else "?") + args.kv_options if args.kv_options else url
    runners = [
        KvstoreRunner(kv_url, size, n, args.batch, data),
        RedisPyRunner(url, size, n, args.batch, data),
    ]
    await runners[1].open()
    runners.append(TierRunner(kv_url, size, n, args.batch, data))
    if args.lmcache:
        runners.append(LMCacheRunner(url, size, n, args.batch, data))
    # Rounds interleave the clients (order rotated) so drift on a shared machine hits all
    # of them alike; ratios are taken per round, then the median of rounds is reported.
    puts: dict[str, list[float]] = {r.name: [] for r in runners}
    gets: dict[str, list[float]] = {r.name: [] for r in runners} | {"kvstore-views": []}
    for rep in range(args.repeat):
        order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
        for r in order:
            puts[r.name].append(await timed(r.put, nbytes))
        for r in order:
            gets[r.name].append(await timed(r.get, nbytes))
        gets["kvstore-views"].append(await timed(runners[0].get_views, nbytes))
    await runners[0].check()
    for r in runners:
        await r.close()
    flush = plain_client(url)
    await flush.flushdb()
    await flush.aclose()
    return puts, gets


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="Redis URL; default: start a throwaway redis-server")
    ap.add_argument("--sizes", default="1,8,32", help="object sizes in MiB (default 1,8,32)")
    ap.add_argument("--total-mib", type=int, default=128, help="MiB moved per phase (default 128)")
    ap.add_argument("--batch", type=int, default=4, help="objects per batch (default 4)")
    ap.add_argument("--repeat", type=int, default=11, help="interleaved rounds (default 11)")
    ap.add_argument("--kv-options", default="", help="extra kvstore URL options, e.g. pipeline_max=256KiB")
    ap.add_argument("--no-lmcache", dest="lmcache", action="store_false", help="skip LMCache's connector")
    args = ap.parse_args()
    torch.set_num_threads(1)

    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from kvstore.testing.redis_server import RedisServer

            url = stack.enter_context(RedisServer()).url
        print(
            f"# Redis tier benchmark ({platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()})"
        )
        print(
            f"batch={args.batch}, {args.total_mib} MiB per phase, {args.repeat} interleaved rounds; "
            "MiB/s = median of rounds; ratio = median of per-round kvstore/redis-py\n"
        )
        head = (
            "| size | kvstore put | redis-py SET | put ratio | kvstore get | redis-py GET | get ratio "
            "| kvstore get, no alloc | Tier put (frames) | Tier get (frames) |"
        )
        if args.lmcache:
            head += " LMCache put | LMCache get |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for s in (int(x) for x in args.sizes.split(",")):
            puts, gets = await run_size(url, s, args)
            kv, rp, lm = "kvstore", "redis-py", "LMCache RedisConnector"
            put_ratio = median([a / b for a, b in zip(puts[kv], puts[rp])])
            get_ratio = median([a / b for a, b in zip(gets[kv], gets[rp])])
            row = (
                f"| {s} MiB | {median(puts[kv]):.0f} | {median(puts[rp]):.0f} | {put_ratio:.2f} "
                f"| {median(gets[kv]):.0f} | {median(gets[rp]):.0f} | {get_ratio:.2f} "
                f"| {median(gets['kvstore-views']):.0f} "
                f"| {median(puts['kvstore Tier']):.0f} | {median(gets['kvstore Tier']):.0f} |"
            )
            if args.lmcache:
                row += f" {median(puts[lm]):.0f} | {median(gets[lm]):.0f} |"
            print(row, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
