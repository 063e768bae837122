"""The body of `kvstore bench`: chunks through a tier vs the plain-client baseline.

Owns: workload generation (realistic KV chunk shapes), the timed put/get passes and
the result record.  Must not touch: backend internals (it uses the public Tier and
Backend APIs only) or printing (the CLI formats `BenchResult`).

Method: one warm-up round (not counted), then `rounds` rounds of puts then gets; in
each pass the two sides take turns batch by batch (`concurrency` operations in flight,
who goes first swapped every batch), each operation reading into its own reused
buffer; medians (and the median of the per-round ratios) are reported, so slow drift of the machine hits both
sides alike.  With ``through="tier"`` (the default) kvstore's side is the full stack:
raw codec, frame with checksum, backend, and on get the payload lands in a reused
tensor of the chunk's shape, its key and checksum verified (the read a store makes for
LMCache: streamed, or for warm disk objects copied from a mapping of the file);
``through="backend"`` times the backend alone moving the same framed bytes.  For ``file://``,
``cache="cold"`` drops the written files from the page cache before every get pass
(both sides), so reads come from the device; ``"warm"`` reads from the page cache.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from kvstore.backends import open_backend
from kvstore.throughput import baseline_for
from kvstore.tier import Tier

MiB = 1 << 20
# Llama-3.1-8B, bf16: 32 layers x (8 KV heads x 128) x K and V = 128 KiB per token
KV_LAYERS, KV_HIDDEN = 32, 1024


@dataclass(frozen=True, slots=True)
class BenchResult:
    url: str
    size: int
    count: int
    concurrency: int
    rounds: int
    cache: str
    through: str
    shape: tuple[int, ...]
    baseline: str
    put_mib_s: float
    get_mib_s: float
    baseline_put_mib_s: float
    baseline_get_mib_s: float
    put_ratio: float
    get_ratio: float
    per_round: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def chunk_shape(size: int) -> tuple[int, ...]:
    """A KV_2LTD shape [2, L, T, H*D] of `size` bytes in bf16, or flat if it doesn't divide."""
    per_token = 2 * KV_LAYERS * KV_HIDDEN * 2
    if size % per_token == 0:
        return (2, KV_LAYERS, size // per_token, KV_HIDDEN)
    if size % 2 == 0:
        return (size // 2,)
    raise ValueError("chunk size must be even (bf16 elements)")


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def _interleaved(
    n: int,
    concurrency: int,
    sides: list[tuple[str, Callable[[int, int], Awaitable[None]]]],
    tick: Callable[[], None],
) -> dict[str, float]:
    """Seconds each side spends on `n` objects, `concurrency` at a time.

    The sides take turns batch by batch (and swap who goes first every batch), so a
    slow spell of a noisy device lands on both alike.
    """
    spent = {label: 0.0 for label, _ in sides}
    for b, start in enumerate(range(0, n, concurrency)):
        batch = range(start, min(start + concurrency, n))
        for label, op in sides if b % 2 == 0 else sides[::-1]:
            t0 = time.perf_counter()
            await asyncio.gather(*(op(w, i) for w, i in enumerate(batch)))
            spent[label] += time.perf_counter() - t0
            for _ in batch:
                tick()
    return spent


async def run_bench(
    url: str,
    *,
    size: int = 32 * MiB,
    count: int = 16,
    concurrency: int = 4,
    rounds: int = 3,
    cache: str = "cold",
    through: str = "tier",
    progress: Callable[[int], None] | None = None,
) -> BenchResult:
    """Measure `url` against its baseline; see the module docstring for the method."""
    torch.set_num_threads(1)
    shape = chunk_shape(size)
    distinct = min(count, 4)
    tensors = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(distinct)]
    for t in tensors:
        t.view(torch.int16).random_()
    payloads = [t.view(torch.uint8).reshape(-1).numpy().data for t in tensors]
    names = [f"bench/chunk-{os.getpid()}-{i}" for i in range(count)]
    tier = Tier(open_backend(url), "raw")
    baseline = baseline_for(url)
    await baseline.open(url)
    frame_size = len(b"".join(tier.codec.frame_parts(tensors[0], key=names[0])[:1])) + size
    buffers = [memoryview(bytearray(frame_size + 4096)) for _ in range(concurrency)]
    targets = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(concurrency)]
    tick = (lambda: progress(size)) if progress else (lambda: None)
    cold = cache == "cold" and urlsplit(url).scheme == "file"

    if through not in ("tier", "backend"):
        raise ValueError("through must be 'tier' (frames, codec, checksum) or 'backend' (bytes only)")
    framed = [tier.codec.frame_parts(t, key="bench", layout="KV_2LTD") for t in tensors]

    async def ours_put(w: int, i: int) -> None:
        if through == "tier":
            (ok,) = await tier.put_many([(names[i], tensors[i % distinct])], layout="KV_2LTD")
        else:
            ok = await tier.backend.put(names[i], framed[i % distinct])
        if not ok:
            raise RuntimeError(f"put of {names[i]} failed: {tier.backend.stats().counters}")

    async def ours_get(w: int, i: int) -> None:
        alloc = lambda n, w=w: buffers[w]  # noqa: E731
        got: object
        if through == "tier":
            (got,) = await tier.get_many([names[i]], out=[targets[w]])
        else:
            got = await tier.backend.get(names[i], alloc=alloc)
        if got is None:
            raise RuntimeError(f"get of {names[i]} missed: {tier.backend.stats().counters}")

    async def base_put(w: int, i: int) -> None:
        await baseline.put(i, payloads[i % distinct])

    async def base_get(w: int, i: int) -> None:
        await baseline.get(i, buffers[w][:size])

    def ours_paths() -> list[Path]:
        from kvstore.backends.disk import DiskBackend

        backend = tier.backend
        return [backend.path_of(n) for n in names] if isinstance(backend, DiskBackend) else []

    async def one_round() -> dict[str, float]:
        r = await _interleaved(count, concurrency, [("baseline_put", base_put), ("put", ours_put)], tick)
        if cold:
            base_paths = getattr(baseline, "paths", None)
            _drop_cache([*(base_paths() if base_paths else []), *ours_paths()])
        r |= await _interleaved(count, concurrency, [("baseline_get", base_get), ("get", ours_get)], tick)
        return {k: count * size / MiB / v for k, v in r.items()}

    results: list[dict[str, float]] = []
    try:
        await one_round()  # warm-up: file creation, allocator, thread pool; not counted
        for _ in range(rounds):
            results.append(await one_round())
    finally:
        await tier.delete_many(names)
        await tier.close()
        await baseline.close()

    def med(k: str) -> float:
        return statistics.median(x[k] for x in results)

    return BenchResult(
        url=tier.backend.stats().url,
        size=size,
        count=count,
        concurrency=concurrency,
        rounds=rounds,
        cache=cache if urlsplit(url).scheme == "file" else "n/a",
        through=through,
        shape=shape,
        baseline=baseline.name,
        put_mib_s=med("put"),
        get_mib_s=med("get"),
        baseline_put_mib_s=med("baseline_put"),
        baseline_get_mib_s=med("baseline_get"),
        put_ratio=statistics.median(x["put"] / x["baseline_put"] for x in results),
        get_ratio=statistics.median(x["get"] / x["baseline_get"] for x in results),
        per_round=results,
    )
