"""MP mode measured with LMCache's own tool: ``lmcache bench l2`` on kvstore's L2 adapter
and on LMCache's adapter of the same kind, one process per run, runs alternating.

`bench_l2.py` drives the adapters with kvstore's harness (store tasks one after
another); this script leaves the driving to LMCache's benchmark, which issues
`--in-flight` store / load submits of `--num-keys` keys at once per round, as LMCache's
store controller keeps several store tasks in flight.  Pairs:

* disk:  kvstore ``file://…?fsync=false``  vs LMCache ``fs`` (neither fsyncs)
* redis: kvstore ``redis://``              vs LMCache ``resp`` (one ``redis-server`` the
  script starts, ``FLUSHALL`` before every run)
* s3:    kvstore ``s3://``                 vs LMCache ``s3`` (one SeaweedFS the script
  starts; ``kvbench.localhost`` must resolve to 127.0.0.1, see bench_l2.py)

Each run is ``lmcache bench l2 --l2-adapter JSON --num-keys K --in-flight F
--data-size-kb S --rounds R --no-skip-verify --format json`` (a failed round-trip check
fails the script).  Printed per kind: each side's median throughput, and over the
pairs of runs the ratio LMCache's p50 round time / kvstore's (above 1.0: kvstore is
faster) for store and load, min / median / max.  Every kvstore load checks each chunk's
key and CRC32C; LMCache's adapters check neither.

Usage:
    python benchmarks/bench_l2_tool.py                          # redis, 4 pairs, 32 MiB keys
    python benchmarks/bench_l2_tool.py --kinds disk,redis,s3 --pairs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_l2 import S3_BUCKET, kvstore_spec, lmcache_s3_spec, start_s3


@dataclass
class Pair:
    kind: str
    kvstore: dict
    lmcache: dict | None  # None: LMCache's side cannot run here (said why)
    reset: Callable[[], None]


def run_tool(spec: dict, args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict[str, dict]:
    """One ``lmcache bench l2`` process; its metrics by operation name."""
    cmd = [
        "lmcache", "bench", "l2", "--l2-adapter", json.dumps(spec),
        "--num-keys", str(args.num_keys), "--in-flight", str(args.in_flight),
        "--data-size-kb", str(args.size_kb), "--rounds", str(args.rounds),
        "--no-skip-verify", "--format", "json", "--output", str(out), "-q",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"lmcache bench l2 failed (exit {done.returncode}) for {spec['type']}:\n{tail}")
    metrics = json.loads(out.read_text())["metrics"]
    ops = {m["operation"]: m for m in metrics.values() if isinstance(m, dict) and "operation" in m}
    for op in ("Store", "Load"):
        m = ops[op]
        if m["rounds_timed_out"] or m["total_success"] != m["total_keys"]:
            raise SystemExit(f"{spec['type']}: {op} stored/loaded {m['total_success']} of {m['total_keys']} keys")
    return ops


@contextlib.contextmanager
def pairs(kinds: list[str], root: Path) -> Iterator[list[Pair]]:
    with contextlib.ExitStack() as stack:
        out: list[Pair] = []
        if "disk" in kinds:
            kd, ld = root / "kvstore", root / "lmcache-fs"

            def reset_disk() -> None:
                for d in (kd, ld):
                    shutil.rmtree(d, ignore_errors=True)
                    d.mkdir(parents=True)

            reset_disk()
            out.append(
                Pair("disk", kvstore_spec([f"file://{kd}?fsync=false"]), {"type": "fs", "base_path": str(ld)}, reset_disk)
            )
        if "redis" in kinds:
            from kvstore.testing.redis_server import RedisServer

            server = RedisServer(extra=["--maxmemory", "0"]).start()
            stack.callback(server.close)

            def flush() -> None:
                server.command("FLUSHALL")

            out.append(
                Pair("redis", kvstore_spec([server.url]), {"type": "resp", "host": server.host, "port": server.port}, flush)
            )
        if "s3" in kinds:
            s3, empty_bucket = start_s3(stack)
            out.append(Pair("s3", kvstore_spec([s3.url(S3_BUCKET, "bench-l2-tool")]), lmcache_s3_spec(s3), empty_bucket))
        yield out


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {median(xs):.2f} / {max(xs):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="redis", help="comma-separated: disk, redis, s3")
    p.add_argument("--pairs", type=int, default=4, help="runs of each side, alternating")
    p.add_argument("--num-keys", type=int, default=4, help="keys per submit")
    p.add_argument("--in-flight", type=int, default=2, help="submits in flight per round")
    p.add_argument("--size-kb", type=int, default=32768, help="bytes per key, KiB (32 MiB: a 256-token Llama-8B chunk)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per run")
    args = p.parse_args()
    if shutil.which("lmcache") is None:
        raise SystemExit("the lmcache command is not on PATH: pip install lmcache")
    mib = args.size_kb / 1024
    print(
        f"lmcache bench l2: {args.in_flight} submits x {args.num_keys} keys of {mib:.1f} MiB per round, "
        f"{args.rounds} rounds per run, {args.pairs} runs per side (alternating)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvstore-l2-tool-") as tmp, pairs(args.kinds.split(","), Path(tmp)) as todo:
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}  # with the S3 server's AWS variables, if any
        rows = []
        for pair in todo:
            sides = {"kvstore": pair.kvstore, **({"lmcache": pair.lmcache} if pair.lmcache else {})}
            runs: dict[str, list[dict[str, dict]]] = {name: [] for name in sides}
            for i in range(args.pairs):
                order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
                for name, spec in order:
                    pair.reset()
                    runs[name].append(run_tool(spec, args, Path(tmp) / f"{pair.kind}-{name}-{i}.json", env))
                    print(f"  {pair.kind} {name} run {i + 1}: done", flush=True)
            rows.append((pair, runs))

    def mbps(ops: list[dict[str, dict]], op: str) -> str:
        return f"{median(o[op]['throughput_avg_mbps'] for o in ops) / 1000:.2f}"

    print("\n| kind | side | store GB/s (median of runs) | load GB/s |\n|---|---|---:|---:|")
    for pair, runs in rows:
        for name, ops in runs.items():
            print(f"| {pair.kind} | {name} | {mbps(ops, 'Store')} | {mbps(ops, 'Load')} |")
    print("\n| kvstore vs LMCache (p50 round time, LMCache's / kvstore's, per pair of runs) | store | load |")
    print("|---|---:|---:|")
    for pair, runs in rows:
        if "lmcache" not in runs:
            continue
        ratio = {
            op: [lm[op]["duration_p50_ms"] / kv[op]["duration_p50_ms"] for kv, lm in zip(runs["kvstore"], runs["lmcache"])]
            for op in ("Store", "Load")
        }
        print(f"| {pair.kind} | {spread(ratio['Store'])} | {spread(ratio['Load'])} |")


if __name__ == "__main__":
    main()
