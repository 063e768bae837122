"""The cachegen kernels A/B: this tree's numba kernels against another checkout's, in one
process, on the same real KV, chunk by chunk alternating; outputs must be bit-identical.

Fresh processes and whole-codec runs (`bench_codec.py`) swing 1.5x on these shared VMs
as the host's load changes; two kernels timed side by side on the same inputs, order
alternating per chunk, see the same machine.  Per configuration: median CPU time of the
fused encode kernel (`encode_u16`: quantize, choose tables, rANS) and of `rans_decode`
over every chunk after a warm round, as MB/s of 16-bit KV per CPU-second, and the ratio
(above 1.0: this tree is faster).  The other tree's payload and decoded values are
compared byte for byte with this tree's; a difference fails the run.

Chunks: `bench_codec.heldout_chunks` (real SmolLM2-135M KV, the texts `bench_codec.py
--first-chunk` uses), 256 tokens each.

Usage:
    git archive <rev> | tar -x -C /tmp/old
    python3 benchmarks/bench_codec_kernels.py --against /tmp/old
    python3 benchmarks/bench_codec_kernels.py --against /tmp/old --dtype bfloat16 --configs preset=lmcache
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_codec import heldout_chunks

from kvstore.codec import cachegen, get
from kvstore.codec import cachegen_kernels as this

CONFIGS = [
    "preset=lmcache",
    "profile=smollm2-135m-lmcache",
    "profile=smollm2-135m",
    "profile=smollm2-135m-hq",
    "profile=smollm2-135m-mix",
    "profile=smollm2-135m-mixq",
]


def load_kernels(tree: Path) -> ModuleType:
    path = tree / "kvstore" / "codec" / "cachegen_kernels.py"
    if not path.exists():
        raise SystemExit(f"{path} not found: --against takes the root of a kvstore checkout")
    # Loaded from a copy under a name of its own: numba keys its on-disk cache by source
    # file and records the module's name in it, so loading the other tree's file in place
    # would leave cache entries that tree's own imports then fail to load.
    copy = Path(tempfile.mkdtemp(prefix="kernels-against-")) / "kernels_against.py"
    shutil.copyfile(path, copy)
    spec = importlib.util.spec_from_file_location("kernels_against", copy)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # numba's cache re-imports a kernel's module by name
    spec.loader.exec_module(mod)
    return mod


def input_arg(kernels: ModuleType, dtype: torch.dtype) -> Any:
    """What a tree's `encode_u16` takes for the input dtype: a flag (bfloat16 or not), or,
    before the kernels widened 16-bit floats themselves, a bits -> float32 table."""
    if hasattr(kernels, "_f16_value"):
        return int(dtype == torch.bfloat16)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).float().numpy()


def decode_args(kernels: ModuleType, args: tuple) -> tuple:
    """What a tree's `rans_decode` takes, given this tree's arguments: frequencies and
    cumulative frequencies packed in one table, or, before the kernels packed them, two."""
    if hasattr(kernels, "decoder_table"):
        return args
    tables = next(t for t in cachegen._TABLES.values() if t.fcum is args[3])
    return (*args[:3], tables.freq, tables.cum, *args[4:])


class Capture:
    """The kernel arguments of the codec's last encode and decode."""

    def __init__(self) -> None:
        self.enc: tuple = ()
        self.dec: tuple = ()
        run_ranges = cachegen.CacheGenCodec._run_ranges
        decode = cachegen.rans_decode

        def rr(codec: Any, kernel: Any, ranges: Any, *a: Any) -> Any:
            self.enc = a
            return run_ranges(codec, kernel, ranges, *a)

        def dec(*a: Any) -> Any:
            self.dec = a
            return decode(*a)

        cachegen.CacheGenCodec._run_ranges = rr  # type: ignore[method-assign]
        cachegen.rans_decode = dec


def run(config: str, chunks: list[torch.Tensor], other: ModuleType, rounds: int, cap: Capture) -> str:
    kind, name = config.split("=")
    codec = get("cachegen", threads=1, **{kind: name})
    codec.wait_warm()
    dtype = chunks[0].dtype
    flags = {"this": input_arg(this, dtype), "other": input_arg(other, dtype)}
    kernels = {"this": this, "other": other}
    times: dict[str, list[float]] = {k: [] for k in ("enc this", "enc other", "dec this", "dec other")}
    for r in range(rounds + 1):
        for i, chunk in enumerate(chunks):
            codec.decode(codec.encode(chunk))
            enc, dec = list(cap.enc), list(cap.dec)
            if len(enc[-1]) != 1:
                raise SystemExit("the codec split a chunk across threads: run with threads=1")
            S = enc[0].shape[0]
            outs = {}
            for side in ("this", "other") if (i + r) % 2 else ("other", "this"):
                e = list(enc)
                e[2] = flags[side]
                e[14] = np.zeros_like(enc[14])
                d = list(decode_args(kernels[side], dec))
                d[-5] = np.zeros_like(d[-5])  # out
                t0 = time.process_time()
                kernels[side].encode_u16(*e[:15], e[15][0], 0, S)
                t1 = time.process_time()
                kernels[side].rans_decode(*d)
                t2 = time.process_time()
                outs[side] = (e[14], d[-5])
                if r:  # round 0 warms up (and compiles the other tree's kernels)
                    times["enc " + side].append(t1 - t0)
                    times["dec " + side].append(t2 - t1)
            for a, b in zip(outs["this"], outs["other"]):
                if not np.array_equal(a, b):
                    raise SystemExit(f"{config}: this tree's kernels and the other's disagree (chunk {i})")
    mb = chunks[0].numel() * chunks[0].element_size() / 1e6
    m = {k: statistics.median(v) for k, v in times.items()}
    return (
        f"| {config} | {mb / m['enc other']:.0f} | {mb / m['enc this']:.0f} | "
        f"{m['enc other'] / m['enc this']:.2f} | {mb / m['dec other']:.0f} | {mb / m['dec this']:.0f} | "
        f"{m['dec other'] / m['dec this']:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="root of the other kvstore checkout")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated preset=/profile= names")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--rounds", type=int, default=2, help="timed passes over the chunks (after a warm one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    other = load_kernels(args.against)
    chunks = [c for _, c in heldout_chunks(1024, 256, getattr(torch, args.dtype))]
    cap = Capture()
    print(f"{len(chunks)} chunks {list(chunks[0].shape)} {args.dtype}; other tree: {args.against}")
    print(
        "| codec | encode MB/s, other | this | ratio | decode MB/s, other | this | ratio |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    for config in args.configs.split(","):
        print(run(config, chunks, other, args.rounds, cap), flush=True)
    print("every payload and decoded value bit-identical between the trees")


if __name__ == "__main__":
    main()
