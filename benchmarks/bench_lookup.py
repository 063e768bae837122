"""Lookup latency through the real LMCache engine: kvstore's disk tier vs LMCache's LocalDisk.

LMCache's scheduler side calls ``engine.lookup`` for every request before anything is
loaded, so its latency is paid per request whether or not anything is found. Both
engines (the ``lmcache-disk`` and ``kvstore-disk`` configurations of
``bench_lmcache.py``) store the same prompts, then each round times, per engine and in
an order that alternates every round, ``--lookups`` calls of each kind:

* ``hit``: every chunk of a stored prompt;
* ``miss``: a prompt never stored (the first chunk is unknown);
* ``half``: the first half of a stored prompt, then new tokens.

Figures: microseconds per lookup (median of the round's calls), and the ratio LMCache's
time ÷ kvstore's per round (above 1.0: kvstore faster), min / median / max over rounds.
``torch.set_num_threads(1)``.

By default both engines live in this process, as they did in every figure before
2026-11-28: each engine's threads (LMCache's, kvstore's loop and file watch) then run
beside the other's lookups too.  ``--processes`` gives each engine a process of its own,
as a server has, and drives the two in turn over pipes, in the same alternating order.
The two processes are pinned to one CPU (`--cpu`, default 0; -1: not pinned): on these
VMs one virtual CPU can run 1.6x slower than the other for minutes, which unpinned
processes turned into a ratio of the CPUs rather than of the lookups.

Usage: ``python benchmarks/bench_lookup.py [--chunks 8] [--rounds 9] [--lookups 200] [--processes [--cpu 0]]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
from bench_lmcache import Runner, configs, spread  # noqa: E402

KINDS = ("hit", "miss", "half")
NAMES = ("lmcache-disk", "kvstore-disk")


def prompts(kind: str, ntok: int, lookups: int, stored: torch.Tensor) -> list[torch.Tensor]:
    if kind == "hit":
        return [stored] * lookups
    if kind == "miss":
        return [torch.arange(10_000_000 + i * ntok, 10_000_000 + (i + 1) * ntok) for i in range(lookups)]
    half = ntok // 2
    return [
        torch.cat([stored[:half], torch.arange(50_000_000 + i * half, 50_000_000 + (i + 1) * half)])
        for i in range(lookups)
    ]


def timed(eng, tokens: list[torch.Tensor]) -> tuple[float, list[int]]:
    ts, hits = [], []
    for t in tokens:
        t0 = time.perf_counter()
        hits.append(eng.lookup(t))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), hits


def stored_engine(name: str, folder: Path, chunks: int) -> tuple[Runner, torch.Tensor]:
    """Configuration `name`'s engine with one prompt stored (and found by lookup)."""
    run_args = argparse.Namespace(chunks=chunks, layers=16, heads=8, head_dim=128, connector="none")
    ntok = chunks * 256
    g = torch.Generator().manual_seed(0)
    kv = [
        (
            torch.randn(1, 8, ntok, 128, generator=g).to(torch.bfloat16),
            torch.randn(1, 8, ntok, 128, generator=g).to(torch.bfloat16),
        )
        for _ in range(16)
    ]
    stored = torch.arange(ntok)
    r = Runner(name, configs(folder, None)[name], run_args, kv)
    r.eng.engine.store(stored, kvcaches=kv)
    r.eng.wait_for_writes(120)
    deadline = time.monotonic() + 60
    while r.eng.engine.lookup(stored) < ntok and time.monotonic() < deadline:
        time.sleep(0.001)
    return r, stored


def checked(name: str, kind: str, want: int, eng, tokens: list[torch.Tensor]) -> float:
    med, hits = timed(eng, tokens)
    if set(hits) != {want}:
        raise RuntimeError(f"{name}: {kind} lookups found {sorted(set(hits))}, want {want}")
    return med


def child(name: str, chunks: int, lookups: int, cpu: int) -> None:
    """--processes: one engine; answers "kind" lines on stdin with the median lookup time."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})  # before any thread starts: they all inherit it
    torch.set_num_threads(1)
    ntok = chunks * 256
    want = {"hit": ntok, "miss": 0, "half": ntok // 2}
    with tempfile.TemporaryDirectory() as d:
        r, stored = stored_engine(name, Path(d), chunks)
        out = os.fdopen(os.dup(1), "w", buffering=1)  # LMCache logs to stdout
        out.write("ready\n")
        for line in sys.stdin:
            kind = line.strip()
            tokens = prompts(kind, ntok, lookups, stored)
            out.write(f"{checked(name, kind, want[kind], r.eng.engine, tokens)!r}\n")
    sys.stdout.flush()
    os._exit(0)  # a hung LMCache close leaves non-daemon threads behind


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 tokens per prompt")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--lookups", type=int, default=200, help="lookups of each kind per round and engine")
    ap.add_argument("--processes", action="store_true", help="each engine in a process of its own")
    ap.add_argument("--cpu", type=int, default=0, help="with --processes: the CPU both processes run on (-1: any)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ntok = args.chunks * 256
    want = {"hit": ntok, "miss": 0, "half": ntok // 2}
    times: dict[tuple[str, str], list[float]] = {(n, k): [] for n in NAMES for k in KINDS}
    if args.processes:
        procs = {
            name: subprocess.Popen(
                [sys.executable, __file__, "--child", name, str(args.chunks), str(args.lookups), str(args.cpu)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for name in NAMES
        }

        def ask(name: str, kind: str) -> float:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(kind + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{name}: the engine's process ended (exit {p.wait()})")
            return float(line)

        try:
            for name, p in procs.items():
                assert p.stdout is not None
                while (line := p.stdout.readline()) and line.strip() != "ready":
                    pass
                if not line:
                    raise RuntimeError(f"{name}: the engine's process ended before it was ready (exit {p.wait()})")
            for rnd in range(args.rounds + 1):  # round 0 warms up and checks the answers
                order = list(NAMES) if rnd % 2 else list(NAMES)[::-1]
                for kind in KINDS:
                    for name in order:
                        med = ask(name, kind)
                        if rnd:
                            times[(name, kind)].append(med)
        finally:
            for p in procs.values():
                p.kill()
    else:
        with tempfile.TemporaryDirectory() as d:
            built = [stored_engine(name, Path(d), args.chunks) for name in NAMES]
            try:
                for rnd in range(args.rounds + 1):  # round 0 warms up and checks the answers
                    order = built if rnd % 2 else built[::-1]
                    for kind in KINDS:
                        for r, stored in order:
                            tokens = prompts(kind, ntok, args.lookups, stored)
                            med = checked(r.name, kind, want[kind], r.eng.engine, tokens)
                            if rnd:
                                times[(r.name, kind)].append(med)
            finally:
                for r, _ in built:
                    r.close()
    pinned = f", both on CPU {args.cpu}" if args.cpu >= 0 else ""
    where = f"each engine in its own process{pinned}" if args.processes else "both engines in this process"
    print(
        f"engine.lookup of {args.chunks}-chunk prompts, {args.lookups} per kind, engine and round, "
        f"{args.rounds} rounds, {where}"
    )
    print("| lookup | LMCache LocalDisk us (median of rounds) | kvstore disk us | LMCache ÷ kvstore per round, min / median / max |")
    print("|---|---:|---:|---|")
    for kind in KINDS:
        lm, kvs = times[("lmcache-disk", kind)], times[("kvstore-disk", kind)]
        ratios = [a / b for a, b in zip(lm, kvs)]
        print(
            f"| {kind} | {statistics.median(lm) * 1e6:.0f} | {statistics.median(kvs) * 1e6:.0f} | {spread(ratios)} |"
        )
    sys.stdout.flush()
    os._exit(0)  # a hung LMCache close leaves non-daemon threads behind


if __name__ == "__main__":
    main()
