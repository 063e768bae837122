"""Benchmark: the one-launch row copy (kvstore.gpu.rowcopy) against a plain ``copy_``.

Copies ``--rows`` rows of ``--row-bytes`` each, shuffled, between device memory and
pinned host memory in both directions, and device to device, for several warp counts;
the baseline is one ``copy_`` of the same bytes between the same kinds of memory, timed
in alternation with it (min / median / max of the per-pair ratios). Needs CUDA.

    PYTHONPATH=$PWD python3 benchmarks/bench_rowcopy.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvstore.gpu.rowcopy import copy_rows, word_bytes


def _time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--row-bytes", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--warps", default="1,2,4,8")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    n, rb = args.rows, args.row_bytes
    nbytes = n * rb
    dev_a = torch.randint(0, 256, (n, rb), dtype=torch.uint8, device="cuda")
    dev_b = torch.empty_like(dev_a)
    host_a = torch.randint(0, 256, (n, rb), dtype=torch.uint8).pin_memory()
    host_b = torch.empty((n, rb), dtype=torch.uint8).pin_memory()
    perm = torch.randperm(n)
    print(f"{torch.cuda.get_device_name()}, {n} rows x {rb} bytes = {nbytes / 2**20:.0f} MiB per pass")
    print(f"{'direction':<18}{'warps':>6}{'GB/s':>9}{'copy_ GB/s':>12}{'ratio min / median / max':>27}")
    for name, src, dst in (
        ("device->pinned", dev_a, host_b),
        ("pinned->device", host_a, dev_b),
        ("device->device", dev_a, dev_b),
    ):
        s = (src.data_ptr() + perm * rb).cuda()
        d = (dst.data_ptr() + torch.arange(n) * rb).cuda()
        word = word_bytes(rb, [src.data_ptr(), dst.data_ptr()])
        for warps in (int(w) for w in args.warps.split(",")):

            def rows(warps=warps, s=s, d=d, word=word) -> None:
                copy_rows(s, d, rb, word, num_warps=warps)

            def base(src=src, dst=dst) -> None:
                dst.copy_(src, non_blocking=True)

            rows()
            torch.cuda.synchronize()
            assert torch.equal(dst.cpu(), src.cpu()[perm]), name
            pairs = []
            for _ in range(args.repeats):
                pairs.append((_time(base), _time(rows)))
            ratios = [b / r for b, r in pairs]
            t_rows = statistics.median(r for _, r in pairs)
            t_base = statistics.median(b for b, _ in pairs)
            print(
                f"{name:<18}{warps:>6}{nbytes / t_rows / 1e9:>9.1f}{nbytes / t_base / 1e9:>12.1f}"
                f"{min(ratios):>11.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
