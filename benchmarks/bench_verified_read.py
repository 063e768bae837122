"""What verification costs one read, warm (page cache) and cold (from the device), in one run.

One file of --mib MiB read into a reused buffer (a torch tensor, as LMCache's MemoryObjs
are) by one thread, in interleaved rounds (the order rotates each round):

    preadv            one ``os.preadv`` of the whole file: what an unverified reader such
                      as LMCache's LocalDisk backend or ``fs`` adapter does (the baseline)
    pread+crc         ``kvstore.checksum.pread_crc32c``: 256 KiB blocks, CRC32C over each
                      block right after it lands, the loop outside the GIL (what the disk
                      tier does)
    pread+crc (pkg)   the same loop in Python with the ``crc32c`` package (what the disk
                      tier did before)
    O_DIRECT+crc      cold only: ``O_DIRECT`` reads of 4 MiB blocks into the buffer, CRC32C
                      over each (skips the page cache: no kernel copy, nothing cached)

Cold rounds drop the file from the page cache first (``posix_fadvise(DONTNEED)``).
Prints GB/s min / median / max over rounds and each median as a fraction of ``preadv``'s
in the same mode.

Usage: python benchmarks/bench_verified_read.py [--mib 32] [--rounds 9] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crc32c
import torch

from kvstore import checksum

BLOCK = 256 << 10
DIRECT_BLOCK = 4 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dir", default=None, help="a directory on the device to measure (default: the temp dir)")
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.mib << 20
    fd0, path = tempfile.mkstemp(dir=args.dir)
    os.write(fd0, os.urandom(n))
    os.fsync(fd0)
    os.close(fd0)
    buf = memoryview(torch.empty(n, dtype=torch.uint8).numpy())
    buf[:] = b"\1" * n  # fault the pages in once, as a reused buffer is
    aligned = torch.empty(n + 4096, dtype=torch.uint8)
    skip = (-aligned.data_ptr()) % 4096  # O_DIRECT wants an aligned address
    direct_buf = memoryview(aligned.numpy())[skip : skip + n]

    def one_preadv() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)

    def pread_crc() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            checksum.pread_crc32c(fd, buf, 0)
        finally:
            os.close(fd)

    def blocks(
        into: memoryview, size: int, crc: Callable[[memoryview, int], int], flags: int = 0
    ) -> Callable[[], None]:
        """Read the file into `into` in blocks of `size`, hashing each with `crc`."""

        def run() -> None:
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                c = 0
                for start in range(0, n, size):
                    b = into[start : start + size]
                    os.preadv(fd, [b], start)
                    c = crc(b, c)
            finally:
                os.close(fd)

        return run

    pread_crc_package = blocks(buf, BLOCK, crc32c.crc32c)
    direct_crc = blocks(direct_buf, DIRECT_BLOCK, checksum.crc32c, os.O_DIRECT)

    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    cases: list[tuple[str, str, Callable[[], None]]] = []
    for mode in ("warm", "cold"):
        cases += [
            (mode, "preadv", one_preadv),
            (mode, "pread+crc", pread_crc),
            (mode, "pread+crc (pkg)", pread_crc_package),
        ]
    cases.append(("cold", "O_DIRECT+crc", direct_crc))
    rates: dict[tuple[str, str], list[float]] = {(m, c): [] for m, c, _ in cases}
    try:
        for _, _, fn in cases:  # warm-up: first calls, kernel compile
            fn()
        for r in range(args.rounds):
            for mode, name, fn in cases[r % len(cases) :] + cases[: r % len(cases)]:
                if mode == "cold":
                    drop()
                else:
                    one_preadv()  # into the page cache
                t = time.perf_counter()
                fn()
                rates[(mode, name)].append(n / 1e9 / (time.perf_counter() - t))
    finally:
        os.unlink(path)
    kernel = "vpclmulqdq kernels" if checksum.fast() else "the crc32c package"
    print(
        f"{args.mib} MiB file, {args.rounds} interleaved rounds, one thread; kvstore.checksum uses {kernel}"
    )
    print("| mode | read | GB/s min / median / max | x preadv (medians) |\n|---|---|---:|---:|")
    for (mode, name), xs in rates.items():
        base = median(rates[(mode, "preadv")])
        print(
            f"| {mode} | {name} | {min(xs):.2f} / {median(xs):.2f} / {max(xs):.2f} | {median(xs) / base:.2f} |"
        )


if __name__ == "__main__":
    main()
