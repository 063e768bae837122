"""Page-cache-warm file reads on 1, 2 and 4 threads: plain ``preadv``, ``pread_crc32c``
(CRC32C folded into the read) and ``mapped_crc32c`` (the copy through a mapping of the
file, the disk tier's default for cached files).

``--chunks`` files of ``--mib`` MiB each are read into reused buffers by a thread pool of
each size, every method and pool size in an order that rotates every round.  Figures:
milliseconds for all the files (min / median / max over rounds) and GB/s at the median.
It shows what the copy alone costs a batched load and how each method scales with
threads on this machine (the mapping's calls contend for the process's address space).

Usage: ``python benchmarks/bench_read_threads.py [--chunks 8] [--mib 5.625] [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.checksum import mapped_crc32c, pread_crc32c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--mib", type=float, default=5.625, help="MiB per file (5.625: a SmolLM2 chunk)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    size = int(args.mib * (1 << 20))
    root = Path(tempfile.mkdtemp(prefix="bench-read-threads-", dir=args.dir))
    paths = [root / str(i) for i in range(args.chunks)]
    for path in paths:
        path.write_bytes(os.urandom(size))
    bufs = [bytearray(size) for _ in paths]

    def reader(how: str) -> Callable[[int], None]:
        def read(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                if how == "preadv":
                    os.preadv(fd, [bufs[i]], 0)
                elif how == "pread_crc32c":
                    pread_crc32c(fd, bufs[i], 0)
                elif mapped_crc32c(fd, bufs[i], 0) is None:
                    raise SystemExit("the mapped copy does not serve here (no kernels, or not cached)")
            finally:
                os.close(fd)

        return read

    cases = [(how, n) for how in ("preadv", "pread_crc32c", "mapped_crc32c") for n in (1, 2, 4)]
    pools = {n: ThreadPoolExecutor(n) for n in (1, 2, 4)}
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds + 1):
        k = r % len(cases)
        for how, n in cases[k:] + cases[:k]:
            fn = reader(how)
            t0 = time.perf_counter()
            list(pools[n].map(fn, range(args.chunks)))
            if r:  # round 0 warms up
                times[(how, n)].append(time.perf_counter() - t0)
    for pool in pools.values():
        pool.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    total = size * args.chunks
    print(f"\n{args.chunks} files of {args.mib} MiB, page-cache warm, {args.rounds} rounds\n")
    print("| method | threads | ms for all, min / median / max | GB/s at the median |")
    print("|---|---:|---|---:|")
    for how, n in cases:
        ts = times[(how, n)]
        print(
            f"| {how} | {n} | {min(ts) * 1e3:.2f} / {median(ts) * 1e3:.2f} / {max(ts) * 1e3:.2f} "
            f"| {total / median(ts) / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
