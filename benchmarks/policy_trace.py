"""Hit ratios of every placement policy on a Mooncake-format trace, one tier.

Usage:
    python benchmarks/policy_trace.py --trace ../shared/traces/mooncake_conversation_a.jsonl [--split] [--jobs 2]

For each policy and capacity (5/10/25% of the distinct blocks) it runs the same
simulator as `kvstore simulate --capacity-fraction F --policy P --json` and prints a
markdown table (hit ratio, and seconds per replay).  With --split it also replays the
first and the second half of the trace on their own (each half's own distinct blocks
set its capacities): the default policy has no constants fitted to any of them.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from kvstore.policy import POLICIES
from kvstore.policy.simulate import single_tier
from kvstore.policy.trace import read_trace

FRACTIONS = (0.05, 0.10, 0.25)
ORDER = ["lru", "lfu", "arc", "wtinylfu", "chain", "reuse", "belady"]


def run(args: tuple[str, str, int, int | None, str, float]) -> tuple[str, str, float, float, float]:
    path, label, skip, limit, policy, fraction = args
    reqs = read_trace(path, limit=None if limit is None else skip + limit)[skip:]
    t0 = time.perf_counter()
    res = single_tier(reqs, fraction, policy)
    return label, policy, fraction, res.hit_ratio, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--split", action="store_true", help="also replay each half of the trace")
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    n = len(read_trace(opts.trace))
    sets = [("whole", 0, None)]
    if opts.split:
        sets += [("first half", 0, n // 2), ("second half", n // 2, None)]
    jobs = [
        (opts.trace, label, skip, limit, p, f)
        for label, skip, limit in sets
        for p in ORDER
        if p in POLICIES
        for f in FRACTIONS
    ]
    with ProcessPoolExecutor(opts.jobs) as pool:
        results = list(pool.map(run, jobs))
    table: dict[tuple[str, str], dict[float, tuple[float, float]]] = {}
    for label, policy, fraction, ratio, secs in results:
        table.setdefault((label, policy), {})[fraction] = (ratio, secs)
    for label, _, _ in sets:
        print(f"\n### {label} ({'all' if label == 'whole' else 'half of the'} requests)\n")
        print("| policy | " + " | ".join(f"{int(f * 100)}%" for f in FRACTIONS) + " | s per replay |")
        print("|---|" + "---:|" * (len(FRACTIONS) + 1))
        for p in ORDER:
            row = table[(label, p)]
            secs = max(v[1] for v in row.values())
            print(f"| {p} | " + " | ".join(f"{row[f][0]:.3f}" for f in FRACTIONS) + f" | {secs:.1f} |")


if __name__ == "__main__":
    main()
