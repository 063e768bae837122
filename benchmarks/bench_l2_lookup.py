"""MP mode: lookup latency of kvstore's L2 adapter against LMCache's ``fs_native`` and ``fs`` (or ``resp``).

LMCache's MP server asks its L2 adapters about a request's chunks (a lookup-and-lock
task) whenever its L1 does not hold them all, before anything is loaded, so the time a
lookup takes is paid by every such request, hit or not.  Each adapter is driven as the
server drives it (`kvstore_lmcache.l2_sync.SyncL2`: submit, wait on the lookup event fd,
collect the bitmap; a hit's locks are released after its timing).  Every adapter stores
the same prompts first (``--prompts`` of ``--chunks`` chunks, SmolLM2-sized 5.6 MiB
objects, page-cache warm), then each round times, per adapter and in an order that
alternates every round, ``--lookups`` lookups of each kind:

* ``hit``: every chunk of a stored prompt;
* ``miss``: a prompt never stored (no chunk is held);
* ``half``: the first half of a stored prompt, then chunks never stored.

kvstore answers a lookup its books can answer on the caller's thread, asking a disk tier
about the chunks it does not hold (`kvstore.tiered.lookup`): from the kernel's file events
where the tier watches its folders (`kvstore.backends.disk_watch`, the default on a local
file system), else a ``stat`` each for at most 64 chunks (``--watch false``; a longer
miss goes to its loop then: ``--chunks`` above 64 times that path).

Figures: microseconds per lookup (the median of the round's calls, then the median of the
rounds), and per round LMCache's time ÷ kvstore's (above 1.0: kvstore answers faster),
min / median / max over rounds.  ``torch.set_num_threads(1)``.

``--kind redis`` compares kvstore's ``redis://`` tier with LMCache's ``resp`` adapter on one
local ``redis-server`` the script starts (kvstore asks Redis on its loop: a Redis tier
cannot answer on the caller's thread).

Usage: ``python benchmarks/bench_l2_lookup.py [--kind disk|redis] [--chunks 8] [--rounds 9] [--lookups 200]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from bench_l2 import SHAPES, build_adapter, kvstore_spec, spread  # noqa: E402

from kvstore_lmcache.l2_sync import SyncL2, object_key  # noqa: E402

KINDS = ("hit", "miss", "half")


def us(xs: list[float]) -> str:
    """The median of per-round medians, in microseconds."""
    return f"{statistics.median(xs) * 1e6:.0f}"
MISS_BASE = 1 << 40  # keys of chunks never stored


def adapters(root: str, kind: str, stack: contextlib.ExitStack, watch: str = "true") -> dict[str, SyncL2]:
    """kvstore's adapter first, then LMCache's of the same kind."""
    if kind == "redis":
        from kvstore.testing.redis_server import RedisServer

        server = RedisServer(extra=["--maxmemory", "0"]).start()
        stack.callback(server.close)
        specs = {
            "kvstore-redis": kvstore_spec([server.url]),
            "lmcache-resp": {"type": "resp", "host": server.host, "port": server.port},
        }
    else:
        specs = {
            "kvstore-file": kvstore_spec([f"file://{root}/kvstore?watch={watch}"]),
            "lmcache-fs-native": {"type": "fs_native", "base_path": f"{root}/lmcache-fs-native"},
            "lmcache-fs": {"type": "fs", "base_path": f"{root}/lmcache-fs"},
        }
    out = {}
    for name, spec in specs.items():
        try:
            out[name] = SyncL2(build_adapter(spec), timeout_s=60)
        except Exception as exc:  # an LMCache without that adapter: compare with the rest
            print(f"  ({name} skipped: {exc})", flush=True)
    return out


def keys_for(kind: str, prompt: int, fresh: int, chunks: int) -> list:
    held = [object_key(prompt * chunks + i) for i in range(chunks)]
    new = [object_key(MISS_BASE + fresh * chunks + i) for i in range(chunks)]
    if kind == "hit":
        return held
    if kind == "miss":
        return new
    return held[: chunks // 2] + new[chunks // 2 :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks per prompt (keys per lookup)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts stored before the rounds")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--lookups", type=int, default=200, help="lookups per kind, adapter and round")
    ap.add_argument("--kind", choices=("disk", "redis"), default="disk", help="disk: vs fs_native and fs; redis: vs resp")
    ap.add_argument("--watch", choices=("true", "false"), default="true", help="the disk tier's watch option")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = SHAPES["smollm2"]
    data = [torch.randn(shape).to(torch.bfloat16) for _ in range(args.chunks)]
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root, contextlib.ExitStack() as stack:
        ads = adapters(root, args.kind, stack, args.watch)
        ours = next(iter(ads))
        try:
            for l2 in ads.values():
                for p in range(args.prompts):
                    assert l2.store(keys_for("hit", p, 0, args.chunks), data), "store failed"
            fresh = 0
            for r in range(args.rounds):
                order = list(ads) if r % 2 == 0 else list(ads)[::-1]
                for kind in KINDS:
                    for name in order:
                        l2 = ads[name]
                        gc.collect()
                        calls = []
                        for i in range(args.lookups):
                            fresh += 1
                            keys = keys_for(kind, i % args.prompts, fresh, args.chunks)
                            t0 = time.perf_counter()
                            hits = l2.lookup(keys)
                            calls.append(time.perf_counter() - t0)
                            want = {"hit": args.chunks, "miss": 0, "half": args.chunks // 2}[kind]
                            assert sum(hits) == want, f"{name} {kind}: {sum(hits)} of {len(keys)} found"
                            l2.unlock(keys)
                        times.setdefault((name, kind), []).append(statistics.median(calls))
        finally:
            for l2 in ads.values():
                l2.adapter.close()  # type: ignore[attr-defined]
    print(
        f"\nL2 lookup-and-lock of {args.chunks}-chunk prompts, {args.lookups} per kind, adapter and round, "
        f"{args.rounds} rounds; us per lookup (median of rounds)\n"
    )
    others = [n for n in ads if n != ours]
    print(
        f"| lookup | {ours} us | "
        + " | ".join(f"{n} us" for n in others)
        + " | "
        + " | ".join(f"{n} ÷ kvstore per round" for n in others)
        + " |"
    )
    print("|---|---:|" + "---:|" * len(others) + "---|" * len(others))
    for kind in KINDS:
        kv = times[(ours, kind)]
        cells = [us(kv)] + [us(times[(n, kind)]) for n in others]
        ratios = [spread([a / b for a, b in zip(times[(n, kind)], kv)]) for n in others]
        print(f"| {kind} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
