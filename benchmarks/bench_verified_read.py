"""What verification costs a page-cache-warm read, on this machine, in one run.

One 32 MiB file in the page cache, read into a reused buffer: a single ``preadv``
(what an unverified reader such as LMCache's fs adapter does), the same in 256 KiB and
1 MiB blocks with CRC32C fed each block while it is in cache (what kvstore's streamed
reads do), the blocks without CRC, and CRC32C alone over the buffer.  Prints GB/s
(median of 15) and each as a fraction of the single ``preadv``.

Usage: python benchmarks/bench_verified_read.py [--mib 32] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from statistics import median

import crc32c
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    n = args.mib << 20
    fd0, path = tempfile.mkstemp(dir=args.dir)
    os.write(fd0, os.urandom(n))
    os.close(fd0)
    # a torch tensor, as the MemoryObjs reads land in (a bytearray or a numpy buffer of
    # the same size measured ~3x slower to copy into on this VM)
    buf = memoryview(torch.empty(n, dtype=torch.uint8).numpy())

    def whole() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, [buf], 0)
        os.close(fd)

    def blocks(size: int, check: bool) -> Callable[[], None]:
        def run() -> None:
            fd = os.open(path, os.O_RDONLY)
            c = 0
            for start in range(0, n, size):
                b = buf[start : start + size]
                os.preadv(fd, [b], start)
                if check:
                    c = crc32c.crc32c(b, c)
            os.close(fd)

        return run

    cases = [
        ("one preadv", whole),
        ("256 KiB blocks + CRC32C", blocks(256 << 10, True)),
        ("1 MiB blocks + CRC32C", blocks(1 << 20, True)),
        ("256 KiB blocks, no CRC", blocks(256 << 10, False)),
        ("CRC32C alone", lambda: crc32c.crc32c(buf)),
    ]
    try:
        whole()  # into the page cache
        rates = {}
        for name, fn in cases:
            times = []
            for _ in range(15):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            rates[name] = n / 1e9 / median(times)
    finally:
        os.unlink(path)
    base = rates["one preadv"]
    print("| read | GB/s | x one preadv |\n|---|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {r:.2f} | {r / base:.2f} |")


if __name__ == "__main__":
    main()
