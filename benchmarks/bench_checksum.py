"""Checksum candidates for frames, against this machine's disk read rate, same run.

    python3 benchmarks/bench_checksum.py [--size-mib 32] [--dir DIR]

Prints GiB/s of each checksum over a 32 MiB payload (kvstore's frame checksum,
`kvstore.checksum.crc32c`, first: the vpclmulqdq kernels where the CPU has them) and the cold (page cache dropped)
and warm os.preadv rates of a file of that size, and what fraction of a read each
checksum adds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import crc32c
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstore import checksum


def rate(fn, data: bytes, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    fn(data)
    t = time.perf_counter()
    for _ in range(reps):
        fn(data)
    return len(data) * reps / (time.perf_counter() - t) / (1 << 30)


def streaming_xxh3(data: bytes) -> int:
    h = xxhash.xxh3_64()
    h.update(data)
    return h.intdigest()


def read_rate(path: str, size: int, cold: bool, reps: int = 8) -> float:
    buf = bytearray(size)
    total = 0.0
    for _ in range(reps):
        fd = os.open(path, os.O_RDONLY)
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        os.preadv(fd, [buf], 0)
        total += time.perf_counter() - t
        os.close(fd)
    return size * reps / total / (1 << 30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    size = args.size_mib << 20
    data = os.urandom(size)
    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        cold, warm = read_rate(f.name, size, True), read_rate(f.name, size, False)
    print(f"os.preadv {args.size_mib} MiB: cold {cold:.2f} GiB/s, warm (page cache) {warm:.2f} GiB/s")
    for name, fn in [
        ("kvstore.checksum.crc32c", checksum.crc32c),
        ("crc32c package", crc32c.crc32c),
        ("xxh3_64 one-shot", xxhash.xxh3_64_intdigest),
        ("xxh3_64 streaming", streaming_xxh3),
        ("zlib.crc32", zlib.crc32),
        ("blake2b", lambda d: hashlib.blake2b(d).digest()),
    ]:
        r = rate(fn, data)
        print(
            f"{name:26} {r:6.2f} GiB/s   adds {cold / r:5.1%} to a cold read, {warm / r:5.1%} to a warm one"
        )


if __name__ == "__main__":
    main()
