"""Migration throughput disk → S3 and S3 → disk against the slower backend's plain rate.

    python3 benchmarks/bench_migrate.py [--count 12] [--size-mib 32] [--rounds 3]

Starts its own SeaweedFS on loopback (kvstore/testing/seaweed.py).  Each round, in the
same process and on the same server:

* baseline put: plain aiobotocore ``put_object`` of the same bytes, `concurrency` at a
  time (kvstore/throughput/baseline_s3.py, what ``kvstore bench s3://`` uses);
* ``kvstore migrate`` disk → S3 (verified on read and after write, journaled);
* baseline get: plain ``get_object`` into reused buffers;
* ``kvstore migrate`` S3 → a fresh disk store.

S3 is the slower side in both directions, so its plain put (resp. get) rate is the
reference; the ratio is the median of per-round ratios.  Also reported: the same
migrations with ``--no-verify-after-write`` (what the read-back costs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvstore.backends import open_backend  # noqa: E402
from kvstore.ops.migrate import MigrateOptions, migrate  # noqa: E402
from kvstore.throughput.baseline_s3 import Baseline  # noqa: E402
from kvstore.tier import Tier  # noqa: E402

MiB = 1 << 20


async def one_round(
    s3_url: str, disk_url: str, work: Path, n: int, size: int, conc: int, r: int
) -> dict[str, float]:
    src = open_backend(disk_url)
    payload = bytearray((await src.get_many([f"bench/m{0}"]))[0])  # a real frame's bytes
    base = Baseline()
    await base.open(s3_url)
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(conc)

        async def put(i: int) -> None:
            async with sem:
                await base.put(1000 * r + i, memoryview(payload))

        await asyncio.gather(*(put(i) for i in range(n)))
        out["baseline_put"] = n * size / MiB / (time.perf_counter() - t0)
        bufs = [memoryview(bytearray(len(payload))) for _ in range(conc)]
        free = list(range(conc))

        async def get(i: int) -> None:
            async with sem:
                b = free.pop()
                await base.get(1000 * r + i, bufs[b])
                free.append(b)

        t0 = time.perf_counter()
        await asyncio.gather(*(get(i) for i in range(n)))
        out["baseline_get"] = n * size / MiB / (time.perf_counter() - t0)
    finally:
        await base.close()
    for verify in (True, False):
        tag = "" if verify else "_noverify"
        dst_url = s3_url.replace("/mig?", f"/mig-{r}{tag}?")
        opts = dict(concurrency=conc, verify_after_write=verify)
        s3 = open_backend(dst_url)
        rep = await migrate(src, s3, MigrateOptions(journal=work / f"j-up-{r}{tag}", **opts))
        assert rep.copied == n and not rep.failed, rep
        out[f"up{tag}"] = rep.mib_s
        back = open_backend((work / f"back-{r}{tag}").as_uri() + "?fsync=false")
        rep = await migrate(s3, back, MigrateOptions(journal=work / f"j-down-{r}{tag}", **opts))
        assert rep.copied == n and not rep.failed, rep
        out[f"down{tag}"] = rep.mib_s
        await s3.close()
    await src.close()
    return out


async def main_async(args: argparse.Namespace, s3_url: str) -> None:
    torch.set_num_threads(1)
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-migrate-"))
    disk_url = (work / "src").as_uri() + "?fsync=false"
    tier = Tier.open(disk_url)
    t = torch.empty(size // 2, dtype=torch.bfloat16)
    t.view(torch.int16).random_()
    await tier.put_many([(f"bench/m{i}", t) for i in range(args.count)])
    rounds = [
        await one_round(s3_url, disk_url, work, args.count, size, args.concurrency, r)
        for r in range(args.rounds)
    ]

    def med(k: str) -> float:
        return statistics.median(x[k] for x in rounds)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x[a] / x[b] for x in rounds)

    print(
        f"{args.count} objects x {args.size_mib} MiB, concurrency {args.concurrency}, median of {args.rounds} rounds"
    )
    print(f"{'':34}{'MiB/s':>8}{'reference MiB/s':>17}{'ratio':>8}")
    for label, key, ref in (
        ("migrate disk -> S3", "up", "baseline_put"),
        ("migrate disk -> S3, no read-back", "up_noverify", "baseline_put"),
        ("migrate S3 -> disk", "down", "baseline_get"),
        ("migrate S3 -> disk, no read-back", "down_noverify", "baseline_get"),
    ):
        print(f"{label:34}{med(key):>8.0f}{med(ref):>17.0f}{ratio(key, ref):>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    from kvstore.testing.seaweed import SeaweedS3

    with SeaweedS3() as server, server.credentials_env():
        server.create_bucket("kvstore-bench")
        asyncio.run(main_async(args, server.url("kvstore-bench", "mig")))


if __name__ == "__main__":
    main()
