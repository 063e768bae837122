"""Opening a disk store, and put/get cost, with the shared SQLite index vs the scan it replaced.

    python3 benchmarks/bench_disk_index.py --count 100000 [1000000] [--dir /work] [--ops 2000]

For each count, a store of that many small objects (256 bytes; files written directly)
is opened by:

* ``previous``: the disk backend before the index (the source at ``--prev``, loaded from
  git), whose constructor walks and stats every file on the calling thread (the event
  loop) and sorts them;
* ``walk``: a plain directory walk (names only), the floor for anything that looks at
  every file;
* ``index, first open``: this version on a store it never indexed (an older store): the
  constructor returns at once, one walk fills the index in the index thread;
* ``index, reopen``: this version on an indexed store: no walk.

"blocks the loop" is how long the constructor ran on the calling thread; "usable" is
until the first operation can proceed.  Then ``--ops`` puts (4 KiB, ``fsync=false``, 16
per batch, with ``capacity`` = what was stored, so every put evicts) and gets of the same
objects through both backends open on the same store, taking turns over 4 rounds
(medians of the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.backends.disk import DiskBackend, encode_filename, shard_of  # noqa: E402
from kvstore.backends.disk_index import INDEX_FILE  # noqa: E402

ROUNDS = 4
PREV = "6e0b6d3855baa77bb6250301b1fff06ace42df82"  # the disk backend before the shared index


def load_previous(commit: str, where: Path) -> ModuleType:
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:kvstore/backends/disk.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = where / "kvstore_disk_previous.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kvstore_disk_previous", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def populate(root: Path, count: int, size: int = 256) -> None:
    objects = root / "objects"
    for shard in range(256):
        (objects / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
    data = b"k" * size
    for i in range(count):
        name = f"bench/m/vllm-1-0/{i:016x}"
        fd = os.open(objects / shard_of(name) / encode_filename(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, data)
        os.close(fd)


def plain_walk(root: Path) -> int:
    n = 0
    for shard in os.scandir(root / "objects"):
        n += sum(1 for _ in os.scandir(shard.path))
    return n


async def ops(be: Any, tag: str, n: int) -> tuple[float, float]:
    """(µs per put, µs per get) for n 4 KiB objects, 16 per batch."""
    payload = b"p" * 4096
    names = [f"bench/{tag}/{i:08x}" for i in range(n)]
    t0 = time.perf_counter()
    for start in range(0, n, 16):
        assert all(await be.put_many([(k, payload) for k in names[start : start + 16]]))
    t1 = time.perf_counter()
    for start in range(0, n, 16):
        got = await be.get_many(names[start : start + 16])
        assert all(g is not None for g in got)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


async def bench(count: int, base: Path, n_ops: int, prev: ModuleType) -> list[tuple[str, str, str, str]]:
    root = base / f"store-{count}"
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    populate(root, count)
    print(f"# {count} objects written in {time.perf_counter() - t:.1f}s", flush=True)
    capacity = count * 256
    rows = []

    t = time.perf_counter()
    found = plain_walk(root)
    walk_s = time.perf_counter() - t
    assert found == count
    rows.append(("plain directory walk (names only)", f"{walk_s:.2f}", "", ""))

    t = time.perf_counter()
    old = prev.DiskBackend(root, capacity=capacity, fsync=False)
    prev_s = time.perf_counter() - t
    assert old.stats().objects == count

    for f in root.glob(INDEX_FILE + "*"):
        f.unlink()
    t = time.perf_counter()
    first = DiskBackend(root, capacity=capacity, fsync=False)
    first_block_s = time.perf_counter() - t
    await asyncio.wrap_future(first._opened)
    first_usable_s = time.perf_counter() - t
    assert first.stats().objects == count, first.stats()
    await first.ready()
    await first.close()

    t = time.perf_counter()
    again = DiskBackend(root, capacity=capacity, fsync=False)
    block_s = time.perf_counter() - t
    await asyncio.wrap_future(again._opened)
    usable_s = time.perf_counter() - t
    assert again.index.rebuilt == 0
    await again.ready()  # the background sweep for dead writers' temp files (a walk in a thread)
    swept_s = time.perf_counter() - t

    # both on the same store, taking turns round by round (a slow spell lands on both)
    per: dict[str, list[tuple[float, float]]] = {"prev": [], "new": []}
    for r in range(ROUNDS):
        for tag, be in (("prev", old), ("new", again)):
            per[tag].append(await ops(be, f"{tag}{r}", n_ops // ROUNDS))
    await again.close()

    def med(tag: str, i: int) -> str:
        return f"{statistics.median(x[i] for x in per[tag]):.0f}"

    rows.append(("previous: scan in the constructor", f"{prev_s:.2f}", med("prev", 0), med("prev", 1)))
    rows.append(
        (
            f"index, first open (one walk in the index thread; usable after {first_usable_s:.2f}s)",
            f"{first_block_s:.3f}",
            "",
            "",
        )
    )
    rows.append(
        (
            f"index, reopen (usable after {usable_s:.3f}s; temp-file sweep done after {swept_s:.2f}s)",
            f"{block_s:.3f}",
            med("new", 0),
            med("new", 1),
        )
    )
    shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, nargs="+", default=[100_000])
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp folder)")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--prev", default=PREV, help="git commit of the previous disk backend")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvstore-bench-index-", dir=args.dir))
    try:
        prev = load_previous(args.prev, base)
        for count in args.count:
            rows = asyncio.run(bench(count, base, args.ops, prev))
            print(f"\n{count} objects | blocks the loop (s) | µs/put (evicting) | µs/get")
            print("|---|---:|---:|---:|")
            for r in rows:
                print("| " + " | ".join(r) + " |")
            print(flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
