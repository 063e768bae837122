"""Steady-state loads through L2 adapters built once, as a running ``lmcache server`` has them.

`bench_l2.py` builds a fresh adapter every round, so each round's one load also pays the
adapter's first-use costs.  Here each adapter is built once and stores ``--chunks``
chunks once; then every round, for each adapter in an order that rotates every round,
one lookup-and-lock task for all the chunks, load tasks of ``--batch`` chunks into
preallocated buffers (page-cache warm), and the unlock are timed.  The first round
checks the bytes loaded are the bytes stored.

Adapters (``--kinds``, comma-separated): ``kvstore`` (a ``file://`` tier,
``fsync=false``), ``kvstore-pread`` (the same with ``mmap=false``: copies by ``pread``
instead of through a mapping), ``fs_native`` (LMCache's C++ fs adapter), ``fs`` (its
Python one).

Figures: milliseconds per round (min / median / max) and, per round, each adapter's
time ÷ kvstore's (above 1.0: kvstore faster).  ``torch.set_num_threads(1)``.

``--stores``: each round times one store task of ``--batch`` fresh chunks per adapter
instead (until it has completed), and the process's CPU time meanwhile (every thread's);
then, untimed, deletes them, writes back the page cache (``os.sync()``) and waits 20 ms,
so every round writes into the same settled state.

Usage: ``python benchmarks/bench_l2_steady.py [--shape smollm2] [--chunks 8] [--batch 4] [--rounds 15] [--stores]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch
from bench_l2 import SHAPES, build_adapter, kvstore_spec


def spec(kind: str, root: Path) -> dict:
    if kind == "kvstore":
        return kvstore_spec([f"file://{root}/kvstore?fsync=false"])
    if kind == "kvstore-pread":
        return kvstore_spec([f"file://{root}/kvstore-pread?fsync=false&mmap=false"])
    if kind in ("fs_native", "fs"):
        return {"type": kind, "base_path": str(root / kind)}
    raise SystemExit(f"unknown kind {kind!r}")


def main() -> None:
    from kvstore_lmcache.l2_sync import SyncL2, object_key

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="chunks per load task")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--kinds", default="kvstore,kvstore-pread,fs_native")
    p.add_argument("--dir", default=None, help="where the adapters write (default: a temp dir)")
    p.add_argument("--stores", action="store_true", help="time store tasks of --batch fresh chunks instead")
    args = p.parse_args()
    torch.set_num_threads(1)

    kinds = args.kinds.split(",")
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-l2-steady-"))
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(SHAPES[args.shape], generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    dst = [torch.empty_like(t) for t in data]
    keys = [object_key(i) for i in range(args.chunks)]
    adapters = {k: build_adapter(spec(k, root)) for k in kinds}
    syncs = {k: SyncL2(a, timeout_s=300) for k, a in adapters.items()}
    if args.stores:
        time_stores(args, kinds, syncs, data[: args.batch])
        for a in adapters.values():
            a.close()  # type: ignore[attr-defined]
        os._exit(0)  # LMCache's native threads
    for k, l2 in syncs.items():
        for s in range(0, len(keys), args.batch):
            assert l2.store(keys[s : s + args.batch], data[s : s + args.batch]), f"{k}: store failed"
    times: dict[str, list[float]] = {k: [] for k in kinds}
    phases: dict[str, list[list[float]]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            l2 = syncs[k]
            for d in dst:
                d.zero_()
            t0 = time.perf_counter()
            assert all(l2.lookup(keys)), f"{k}: lookup missed"
            marks = [time.perf_counter()]
            for s in range(0, len(keys), args.batch):
                assert all(l2.load(keys[s : s + args.batch], dst[s : s + args.batch])), f"{k}: load missed"
                marks.append(time.perf_counter())
            l2.unlock(keys)
            t1 = time.perf_counter()
            took = t1 - t0
            steps = [marks[0] - t0] + [b - a for a, b in pairwise(marks)] + [t1 - marks[-1]]
            if r == 0:
                assert all(torch.equal(a, b) for a, b in zip(data, dst)), f"{k}: loaded bytes differ"
                continue  # warm-up round
            times[k].append(took * 1e3)
            phases[k].append([x * 1e3 for x in steps])
    mib = data[0].nbytes / (1 << 20)
    print(f"\n{args.chunks} chunks of {list(data[0].shape)} bf16 ({mib:.1f} MiB each), load tasks of "
          f"{args.batch}, {args.rounds} rounds after a warm-up; adapters built once\n")
    print("| adapter | ms per round min / median / max | ÷ kvstore per round min / median / max |")
    print("|---|---|---|")
    for k in kinds:
        print(f"| {k} | {spread(times[k])} | {vs_kvstore(times, k)} |")
    print("\nMedian ms per step (lookup, each load task, unlock):\n")
    n_loads = len(range(0, len(keys), args.batch))
    print("| adapter | lookup | " + " | ".join(f"load {i + 1}" for i in range(n_loads)) + " | unlock |")
    print("|---|" + "---:|" * (n_loads + 2))
    for k in kinds:
        cols = zip(*phases[k])
        print(f"| {k} | " + " | ".join(f"{median(c):.2f}" for c in cols) + " |")
    for a in adapters.values():
        a.close()  # type: ignore[attr-defined]
    os._exit(0)  # LMCache's native threads


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {median(xs):.2f} / {max(xs):.2f}"


def vs_kvstore(times: dict[str, list[float]], kind: str) -> str:
    """`kind`'s time ÷ kvstore's per round, min / median / max ("" for kvstore itself)."""
    base = times.get("kvstore")
    if base is None or kind == "kvstore":
        return ""
    return spread([t / b for t, b in zip(times[kind], base)])


def time_stores(args: argparse.Namespace, kinds: list[str], syncs: dict, data: list[torch.Tensor]) -> None:
    """`--stores`: one store task of fresh chunks per adapter per round (see the docstring)."""
    from kvstore_lmcache.l2_sync import object_key

    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    n = 1 << 20  # keys apart from the load rounds' ones
    for r in range(args.rounds + 1):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            keys = [object_key(n + i) for i in range(len(data))]
            n += len(data)
            os.sync()
            time.sleep(0.02)
            c0, t0 = time.process_time(), time.perf_counter()
            assert syncs[k].store(keys, data), f"{k}: store failed"
            took, used = time.perf_counter() - t0, time.process_time() - c0
            syncs[k].adapter.delete(keys)
            time.sleep(0.02)  # (kvstore deletes on its loop)
            if r:  # round 0 warms up
                times[k].append(took * 1e3)
                cpu[k].append(used * 1e3)
    mib = data[0].nbytes / (1 << 20)
    print(f"\nstore tasks of {len(data)} fresh chunks of {list(data[0].shape)} bf16 ({mib:.1f} MiB each), "
          f"{args.rounds} rounds after a warm-up; adapters built once\n")
    print("| adapter | ms per task min / median / max | ÷ kvstore per round min / median / max | CPU ms per task, median |")
    print("|---|---|---|---:|")
    for k in kinds:
        print(f"| {k} | {spread(times[k])} | {vs_kvstore(times, k)} | {median(cpu[k]):.2f} |")


if __name__ == "__main__":
    main()
