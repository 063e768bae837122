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

Usage: ``python benchmarks/bench_lookup.py [--chunks 8] [--rounds 9] [--lookups 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 tokens per prompt")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--lookups", type=int, default=200, help="lookups of each kind per round and engine")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_args = argparse.Namespace(chunks=args.chunks, layers=16, heads=8, head_dim=128, connector="none")
    ntok = args.chunks * 256
    g = torch.Generator().manual_seed(0)
    kv = [
        (
            torch.randn(1, 8, ntok, 128, generator=g).to(torch.bfloat16),
            torch.randn(1, 8, ntok, 128, generator=g).to(torch.bfloat16),
        )
        for _ in range(16)
    ]
    stored = torch.arange(ntok)
    want = {"hit": ntok, "miss": 0, "half": ntok // 2}
    times: dict[tuple[str, str], list[float]] = {(n, k): [] for n in NAMES for k in KINDS}
    with tempfile.TemporaryDirectory() as d:
        envs = configs(Path(d), None)
        runners = [Runner(name, envs[name], run_args, kv) for name in NAMES]
        try:
            for r in runners:
                r.eng.engine.store(stored, kvcaches=kv)
                r.eng.wait_for_writes(120)
                deadline = time.monotonic() + 60
                while r.eng.engine.lookup(stored) < ntok and time.monotonic() < deadline:
                    time.sleep(0.001)
            for rnd in range(args.rounds + 1):  # round 0 warms up and checks the answers
                order = runners if rnd % 2 else runners[::-1]
                for kind in KINDS:
                    tokens = prompts(kind, ntok, args.lookups, stored)
                    for r in order:
                        med, hits = timed(r.eng.engine, tokens)
                        if set(hits) != {want[kind]}:
                            raise RuntimeError(f"{r.name}: {kind} lookups found {sorted(set(hits))}, want {want[kind]}")
                        if rnd:
                            times[(r.name, kind)].append(med)
        finally:
            for r in runners:
                r.close()
    print(f"engine.lookup of {args.chunks}-chunk prompts, {args.lookups} per kind, engine and round, {args.rounds} rounds")
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
