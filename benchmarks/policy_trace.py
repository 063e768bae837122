"""Hit ratios of every placement policy on a Mooncake-format trace, one tier.

Usage:
    python benchmarks/policy_trace.py --trace ../shared/traces/mooncake_conversation_a.jsonl [--split] [--jobs 2]
        [--policies lru,chain,reuse] [--parents known|withheld|both]

For each policy and capacity (5/10/25% of the distinct blocks) it runs the same
simulator as `kvstore simulate --capacity-fraction F --policy P --json` and prints a
markdown table (hit ratio, and seconds per replay).  With --split it also replays the
first and the second half of the trace on their own (each half's own distinct blocks
set its capacities): the default policy has no constants fitted to any of them.

--parents withheld stores every block without its chain position (no parent, depth or
prompt-tail flag: `replay(..., parents=False)`, as ``put_many(chained=False)``); both
prints each cell as known / withheld.
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


Job = tuple[str, str, int, int | None, str, float, bool]


def run(args: Job) -> tuple[str, str, float, bool, float, float]:
    path, label, skip, limit, policy, fraction, parents = args
    reqs = read_trace(path, limit=None if limit is None else skip + limit)[skip:]
    t0 = time.perf_counter()
    res = single_tier(reqs, fraction, policy, parents=parents)
    return label, policy, fraction, parents, res.hit_ratio, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--split", action="store_true", help="also replay each half of the trace")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--policies", default=",".join(ORDER), help="comma-separated (default: all)")
    ap.add_argument(
        "--parents",
        choices=("known", "withheld", "both"),
        default="known",
        help="tell the policies each block's chain position, or not, or replay both ways",
    )
    opts = ap.parse_args()
    order = [p for p in opts.policies.split(",") if p]
    unknown = [p for p in order if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies: {', '.join(unknown)} (have: {', '.join(ORDER)})")
    modes = {"known": [True], "withheld": [False], "both": [True, False]}[opts.parents]
    n = len(read_trace(opts.trace))
    sets = [("whole", 0, None)]
    if opts.split:
        sets += [("first half", 0, n // 2), ("second half", n // 2, None)]
    jobs: list[Job] = [
        (opts.trace, label, skip, limit, p, f, parents)
        for label, skip, limit in sets
        for p in order
        for f in FRACTIONS
        for parents in modes
    ]
    with ProcessPoolExecutor(opts.jobs) as pool:
        results = list(pool.map(run, jobs))
    table: dict[tuple[str, str], dict[tuple[float, bool], tuple[float, float]]] = {}
    for label, policy, fraction, parents, ratio, secs in results:
        table.setdefault((label, policy), {})[(fraction, parents)] = (ratio, secs)
    header = {"known": "", "withheld": ", parents withheld", "both": ", parents known / withheld"}
    for label, _, _ in sets:
        which = "all" if label == "whole" else "half of the"
        print(f"\n### {label} ({which} requests{header[opts.parents]})\n")
        print("| policy | " + " | ".join(f"{int(f * 100)}%" for f in FRACTIONS) + " | s per replay |")
        print("|---|" + "---:|" * (len(FRACTIONS) + 1))
        for p in order:
            row = table[(label, p)]
            secs = max(v[1] for v in row.values())
            cells = [" / ".join(f"{row[(f, m)][0]:.3f}" for m in modes) for f in FRACTIONS]
            print(f"| {p} | " + " | ".join(cells) + f" | {secs:.1f} |")


if __name__ == "__main__":
    main()
