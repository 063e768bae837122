"""Where a page-cache-warm load spends its time, layer by layer, in one run.

The same chunks (default: 8 chunks of 32 layers x 8 heads x 128, bf16, 32 MiB each) are
loaded into the same preallocated destination tensors through each layer of the stack,
from the bottom up, in interleaved rounds (the order rotates each round):

    copy        torch copy of the bytes from memory into the destination (the floor)
    preadv      one ``os.preadv`` per chunk from a page-cache-warm file (what LMCache's
                ``fs`` adapter does: no check)
    copy+crc    ``kvstore.checksum.copy_crc32c``: the copy with CRC32C folded into the same
                pass (what a verified read from memory must do at the least)
    preadv+crc  ``kvstore.checksum.pread_crc32c``: the same file read in 256 KiB blocks,
                CRC32C over each block while it is in cache, the loop outside the GIL
                (what a verified read from disk must do at the least)
    mem tier    ``Tier(mem://).get_many``: frame, key and CRC checked, copy out
    disk tier   ``Tier(file://).get_many``: the disk backend's streamed, verified read
    store       ``TieredStore([file://]).get_many``: + lookup, tier deadline and breaker,
                policy bookkeeping
    L2 adapter  kvstore's MP-mode adapter driven as LMCache's server drives it
                (``SyncL2``: lookup-and-lock task, load task, event fds, the runtime's
                loop thread), over the same ``file://`` store

Each stage prints GB/s (min / median / max over rounds), the median wall time per chunk
(the differences between adjacent stages are what that layer costs) and the median CPU
time per chunk over all of the process's threads: the tiers read several chunks at once
on worker threads, the plain copy and ``preadv`` rows run on one thread, so wall time
says what a caller waits and CPU time what it costs.  The first round
checks that every stage loaded the bytes stored.

With ``--stores``, the same for stores of those chunks (fresh names every round; what
a round wrote is deleted after it, untimed):

    write       one ``os.write`` per chunk into a new file, renamed into place (what
                LMCache's ``fs`` adapter does: no check; no fsync on either side)
    crc         ``kvstore.checksum.crc32c`` over the bytes alone (what a frame's checksum
                costs)
    crc+write   the two, one after the other
    mem tier    ``Tier(mem://?capacity=…&preallocate=true).put_many``: frame (CRC32C),
                copy into the tier's arena
    disk tier   ``Tier(file://?fsync=false).put_many``: frame, temp file, rename, index
    store       ``TieredStore([file://…?fsync=false]).put_many``: + placement, quota,
                tier deadline and breaker
    L2 adapter  kvstore's MP-mode adapter store driven as LMCache's server drives it,
                over the same kind of store

With ``--stores --redis``, stores into a ``redis-server`` the script starts (``FLUSHALL``
after every stage, untimed; at most 4 values in flight everywhere, kvstore's default):

    redis-py    plain redis-py asyncio ``SET`` of each chunk's bytes (the baseline)
    raw SET     kvstore's own wire path (`RespStreams.stream_set`), no frame
    crc         as above
    redis tier  ``Tier(redis://).put_many``: frame (CRC32C), streamed SET
    store       ``TieredStore([redis://]).put_many``
    L2 adapter  the MP-mode adapter over that store

Usage:
    python benchmarks/bench_breakdown.py [--rounds 7] [--chunks 8] [--shape smollm2] [--dir DIR] [--stores [--redis]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

SHAPES = {
    "llama8b": (2, 32, 256, 8 * 128),
    "smollm2": (2, 30, 256, 3 * 64),
}
GB = 1e9
Stage = tuple[str, Callable[[], None]]  # a name, and one timed run of it


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {median(xs):.2f} / {max(xs):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    p.add_argument("--stores", action="store_true", help="break down stores instead of loads")
    p.add_argument("--redis", action="store_true", help="with --stores: into a local redis-server")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.stores and args.redis:
        redis_stores(args)
        return
    if args.stores:
        stores(args)
        return

    from benchmarks.bench_l2 import build_adapter, kvstore_spec
    from kvstore import checksum
    from kvstore.tier import Tier
    from kvstore.tiered import TieredStore
    from kvstore_lmcache.keymap import mp_object_name
    from kvstore_lmcache.l2_sync import SyncL2, object_key

    g = torch.Generator().manual_seed(0)
    data = [torch.randn(SHAPES[args.shape], generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    dst = [torch.empty_like(t) for t in data]
    raw = [t.view(torch.uint8).reshape(-1) for t in data]
    views = [d.view(torch.uint8).reshape(-1) for d in dst]
    nbytes = sum(t.nbytes for t in data)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-breakdown-"))
    root.mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete

    # plain files of the same bytes
    paths = []
    for i, t in enumerate(raw):
        path = root / f"plain-{i}"
        path.write_bytes(t.numpy().tobytes())
        paths.append(path)

    def copy() -> None:
        for s, d in zip(raw, views):
            d.copy_(s)

    def preadv() -> None:
        for path, d in zip(paths, views):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [d.numpy().data], 0)
            finally:
                os.close(fd)

    def copy_crc() -> None:
        for s, d in zip(raw, views):
            checksum.copy_crc32c(d.numpy().data, s.numpy().data)

    def preadv_crc() -> None:
        for path, d in zip(paths, views):
            fd = os.open(path, os.O_RDONLY)
            try:
                checksum.pread_crc32c(fd, d.numpy().data, 0)
            finally:
                os.close(fd)

    names = [f"breakdown/chunk-{i}" for i in range(len(data))]
    mem = Tier.open(f"mem://breakdown-{os.getpid()}")
    disk = Tier.open(f"file://{root / 'tier'}")
    run(mem.put_many(list(zip(names, data))))
    run(disk.put_many(list(zip(names, data))))

    def tier_get(tier: Tier) -> Callable[[], None]:
        def go() -> None:
            got = run(tier.get_many(names, out=dst))
            assert all(x is not None for x in got), "tier read missed"

        return go

    store = TieredStore.from_urls([f"file://{root / 'store'}"])
    ok = run(store.put_many(list(zip(names, data))))
    assert all(ok), "store put failed"
    run(store.drain())

    def store_get() -> None:
        got = run(store.get_many(names, out=dst))
        assert all(x is not None for x in got), "store read missed"

    adapter = build_adapter(kvstore_spec([f"file://{root / 'l2'}"]))
    l2 = SyncL2(adapter, timeout_s=300)
    keys = [object_key(i) for i in range(len(data))]
    assert l2.store(keys, data), "adapter store failed"
    assert mp_object_name(keys[0], "default")  # the names the adapter stores under

    def adapter_get() -> None:
        hits = l2.lookup(keys)
        assert all(hits), f"adapter lookup found {sum(hits)} of {len(keys)}"
        got = l2.load(keys, dst)
        assert all(got), "adapter load missed"
        l2.unlock(keys)

    stages: list[Stage] = [
        ("copy", copy),
        ("copy+crc", copy_crc),
        ("preadv", preadv),
        ("preadv+crc", preadv_crc),
        ("mem tier", tier_get(mem)),
        ("disk tier", tier_get(disk)),
        ("store", store_get),
        ("L2 adapter", adapter_get),
    ]

    def clear(_name: str) -> None:
        for d in dst:
            d.zero_()

    def check(name: str, r: int) -> None:
        if r == 0 and name not in ("preadv", "preadv+crc"):
            assert all(torch.equal(a, b) for a, b in zip(data, dst)), f"{name}: bytes differ"

    try:  # warm-up: page cache, numba, first-call paths
        rates, cpu = time_stages(stages, args.rounds, nbytes, before=clear, after=check)
    finally:
        adapter.close()  # type: ignore[attr-defined]
        run(store.close())
        loop.close()
        shutil.rmtree(root, ignore_errors=True)

    report(args, data, stages, rates, cpu, "page-cache warm")


def time_stages(
    stages: list[Stage],
    rounds: int,
    nbytes: int,
    *,
    before: Callable[[str], None] | None = None,
    after: Callable[[str, int], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each stage run once untimed (round -1), then `rounds` interleaved rounds (the order
    rotates each round); per stage, GB/s and CPU seconds (all threads) of each round.
    `before(name)` and `after(name, round)` run untimed around every run."""
    rates: dict[str, list[float]] = {name: [] for name, _ in stages}
    cpu: dict[str, list[float]] = {name: [] for name, _ in stages}
    for r in range(-1, rounds):
        k = max(r, 0) % len(stages)
        for name, fn in stages[k:] + stages[:k]:
            if before is not None:
                before(name)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if r >= 0:
                rates[name].append(nbytes / GB / (time.perf_counter() - t0))
                cpu[name].append(time.process_time() - c0)
            if after is not None:
                after(name, r)
    return rates, cpu


def report(args, data, stages, rates, cpu, what: str) -> None:  # type: ignore[no-untyped-def]
    from kvstore import checksum

    nbytes = sum(t.nbytes for t in data)
    chunk_mib = data[0].nbytes / (1 << 20)
    kernel = f"{checksum.vector_bits()}-bit kernels" if checksum.fast() else "the crc32c package"
    print(
        f"{len(data)} chunks of {chunk_mib:.1f} MiB ({args.shape}), {args.rounds} rounds, {what}; CRC32C by {kernel}"
    )
    print(
        "| stage | GB/s min / median / max | ms per chunk (median) | + over the stage above | CPU ms per chunk |"
    )
    print("|---|---|---:|---:|---:|")
    prev = None
    for name, _ in stages:
        ms = nbytes / GB / median(rates[name]) / len(data) * 1e3
        extra = "" if prev is None else f"{ms - prev:+.2f}"
        cpu_ms = median(cpu[name]) / len(data) * 1e3
        print(f"| {name} | {spread(rates[name])} | {ms:.2f} | {extra} | {cpu_ms:.2f} |")
        prev = ms


def store_chunks(args) -> tuple[list[torch.Tensor], list[memoryview]]:  # type: ignore[no-untyped-def]
    """The chunks a stores breakdown writes, and a byte view of each (no copy)."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(SHAPES[args.shape], generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    return data, [t.view(torch.uint8).reshape(-1).numpy().data for t in data]


def crc_stage(raw: list[memoryview]) -> Callable[[], None]:
    """The ``crc`` stage: CRC32C over each chunk's bytes, what a frame's checksum costs."""
    from kvstore import checksum

    def crc() -> None:
        for b in raw:
            checksum.crc32c(b)

    return crc


def adapter_put_stage(l2: Any, data: list[torch.Tensor], seq: Iterator[int]) -> Callable[[], None]:
    """The ``L2 adapter`` stage: one store task of all chunks under fresh keys."""
    from kvstore_lmcache.l2_sync import object_key

    n = len(data)

    def adapter_put() -> None:
        r = next(seq)
        assert l2.store([object_key(r * n + i) for i in range(n)], data), "adapter store failed"

    return adapter_put


def stores(args) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.bench_l2 import build_adapter, kvstore_spec
    from kvstore.tier import Tier
    from kvstore.tiered import TieredStore
    from kvstore_lmcache.l2_sync import SyncL2

    data, raw = store_chunks(args)
    nbytes = sum(t.nbytes for t in data)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-breakdown-"))
    (root / "plain").mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    n = len(data)
    mem = Tier.open(f"mem://breakdown-{os.getpid()}?capacity={2 * nbytes + (64 << 20)}&preallocate=true")
    disk = Tier.open(f"file://{root / 'tier'}?fsync=false")
    store = TieredStore.from_urls([f"file://{root / 'store'}?fsync=false"])
    adapter = build_adapter(kvstore_spec([f"file://{root / 'l2'}?fsync=false"]))
    l2 = SyncL2(adapter, timeout_s=300)
    seq = iter(range(1 << 40))
    cleanup: list[Callable[[], None]] = []  # what a stage wrote, deleted after its timing

    def write_files() -> None:
        for i, b in enumerate(raw):
            tmp, final = root / "plain" / f".{i}.tmp", root / "plain" / f"{i}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(b)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, final)

    crc = crc_stage(raw)

    def crc_write() -> None:
        crc()
        write_files()

    def tier_put(tier: Tier) -> Callable[[], None]:
        def go() -> None:
            r = next(seq)
            names = [f"breakdown/r{r}-{i}" for i in range(n)]
            assert all(run(tier.put_many(list(zip(names, data))))), "tier put failed"
            if tier is disk:
                cleanup.append(lambda: run(tier.backend.delete_many(names)) and None)

        return go

    def store_put() -> None:
        r = next(seq)
        names = [f"breakdown/r{r}-{i}" for i in range(n)]
        assert all(run(store.put_many(list(zip(names, data))))), "store put failed"
        cleanup.append(lambda: run(store.delete_many(names)) and None)

    adapter_put = adapter_put_stage(l2, data, seq)

    stages: list[Stage] = [
        ("write", write_files),
        ("crc", crc),
        ("crc+write", crc_write),
        ("mem tier", tier_put(mem)),
        ("disk tier", tier_put(disk)),
        ("store", store_put),
        ("L2 adapter", adapter_put),
    ]

    def clean_up(_name: str, _round: int) -> None:
        while cleanup:
            cleanup.pop()()

    try:  # warm-up: first-call paths, the arena's first fill
        rates, cpu = time_stages(stages, args.rounds, nbytes, after=clean_up)
    finally:
        adapter.close()  # type: ignore[attr-defined]
        run(store.close())
        loop.close()
        shutil.rmtree(root, ignore_errors=True)
    report(args, data, stages, rates, cpu, "stores, no fsync")


def redis_stores(args) -> None:  # type: ignore[no-untyped-def]
    import redis.asyncio as aioredis

    from benchmarks.bench_l2 import build_adapter, kvstore_spec
    from kvstore.backends.redis_stream import Address, RespStreams
    from kvstore.testing.redis_server import RedisServer
    from kvstore.tier import Tier
    from kvstore.tiered import TieredStore
    from kvstore_lmcache.l2_sync import SyncL2

    data, raw = store_chunks(args)
    nbytes = sum(t.nbytes for t in data)
    n = len(data)
    inflight = 4
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    with RedisServer() as server:
        plain = aioredis.Redis(host=server.host, port=server.port, max_connections=inflight)
        streams = RespStreams(Address(host=server.host, port=server.port), size=inflight)
        tier = Tier.open(server.url)
        store = TieredStore.from_urls([server.url])
        adapter = build_adapter(kvstore_spec([server.url]))
        l2 = SyncL2(adapter, timeout_s=300)
        seq = iter(range(1 << 40))

        async def limited(calls: list[Callable[[], Any]]) -> list[Any]:
            sem = asyncio.Semaphore(inflight)

            async def one(call: Callable[[], Any]) -> Any:
                async with sem:
                    return await call()

            return await asyncio.gather(*(one(c) for c in calls))

        def names() -> list[str]:
            r = next(seq)
            return [f"breakdown/r{r}-{i}" for i in range(n)]

        def redis_py() -> None:
            ks = names()
            assert all(run(limited([lambda k=k, b=b: plain.set(k, b) for k, b in zip(ks, raw)])))

        def raw_set() -> None:
            ks = names()
            calls = [
                lambda k=k, b=b: streams.stream_set(k.encode(), [memoryview(b)], None)
                for k, b in zip(ks, raw)
            ]
            assert all(run(limited(calls)))

        def tier_put() -> None:
            assert all(run(tier.put_many(list(zip(names(), data))))), "tier put failed"

        def store_put() -> None:
            assert all(run(store.put_many(list(zip(names(), data))))), "store put failed"

        stages: list[Stage] = [
            ("redis-py", redis_py),
            ("raw SET", raw_set),
            ("crc", crc_stage(raw)),
            ("redis tier", tier_put),
            ("store", store_put),
            ("L2 adapter", adapter_put_stage(l2, data, seq)),
        ]

        def flush(_name: str, _round: int) -> None:
            run(plain.flushall())

        try:
            rates, cpu = time_stages(stages, args.rounds, nbytes, after=flush)
        finally:
            adapter.close()  # type: ignore[attr-defined]
            run(store.close())
            run(tier.close())
            run(plain.aclose())
            streams.close()
            loop.close()
    report(args, data, stages, rates, cpu, f"stores into redis-server, {inflight} in flight")


if __name__ == "__main__":
    main()
