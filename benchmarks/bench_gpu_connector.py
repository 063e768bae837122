"""Benchmark: paged KV gather/scatter through the kvstore.gpu connectors.

Measures store (paged cache -> chunk memory objects) and load (memory objects -> paged
cache) throughput, whole-chunk and layerwise, against a plain ``copy_`` of the same
number of bytes measured in the same run on the same machine (pinned host memory when
CUDA is used; two ordinary host tensors on CPU). On CUDA it also measures how much of
the layerwise copy time hides behind per-layer compute (a matmul standing in for
attention).

    PYTHONPATH=$PWD python3 benchmarks/bench_gpu_connector.py            # CUDA if present
    PYTHONPATH=$PWD python3 benchmarks/bench_gpu_connector.py --device cpu --json out.json

Each repeat times the baseline and the mode back to back; the reported ratios are the
min / median / max of those per-pair ratios (robust to a busy machine); the absolute GB/s
depend on the machine. ``--pageable`` puts the memory objects in unpinned host memory, so
CUDA copies go through the pinned staging pool. ``scripts/gpu_check.sh`` runs this for
every layout together with the CUDA tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvstore.gpu.connector import LayerwisePagedKVConnector, PagedKVConnector

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _memobj(shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat, pin: bool) -> TensorMemoryObj:
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    raw.fill_(0)
    meta = MemoryObjMetadata(
        shape=shape,
        dtype=dtype,
        address=0,
        phy_size=nbytes,
        ref_count=1,
        pin_count=0,
        fmt=fmt,
        shapes=[shape],
        dtypes=[dtype],
    )
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def _caches(args, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    nb, bs, h, d = args.num_blocks, args.block_size, args.heads, args.head_size
    shape = {
        "flash_attn": (2, nb, bs, h, d),
        "flash_infer": (nb, 2, bs, h, d),
        "mla": (nb, bs, d),
    }[args.layout]
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype=dtype, device=device) for _ in range(args.layers)]


def _slot_mapping(args, num_tokens: int, device: torch.device) -> torch.Tensor:
    need = -(-num_tokens // args.block_size)
    if need > args.num_blocks:
        sys.exit(f"--num-blocks {args.num_blocks} holds fewer than the {need} blocks the chunks need")
    blocks = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(1))[:need]
    t = torch.arange(num_tokens)
    return (blocks[t // args.block_size] * args.block_size + t % args.block_size).to(device)


def request(args, device: torch.device, dtype: torch.dtype):
    """Random paged caches, zeroed ones like them, and a request of ``--chunks`` chunks on
    shuffled blocks: (caches, fresh, slot_mapping, starts, ends)."""
    caches = _caches(args, device, dtype)
    fresh = [torch.zeros_like(c) for c in caches]
    slots = _slot_mapping(args, args.chunks * args.chunk_size, device)
    starts = [i * args.chunk_size for i in range(args.chunks)]
    ends = [s + args.chunk_size for s in starts]
    return caches, fresh, slots, starts, ends


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _timed(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds per call (device work included)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_time_once(fn, device) for _ in range(repeats))


def _paired(fn, base, device: torch.device, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Alternate ``base`` and ``fn`` so both see the same machine load; return the median
    seconds of each and the min / median / max of the per-pair ratios ``base / fn``."""
    for _ in range(warmup):
        base()
        fn()
    pairs = []
    for _ in range(repeats):
        tb = _time_once(base, device)
        tf = _time_once(fn, device)
        pairs.append((tb, tf))
    ratios = [tb / tf for tb, tf in pairs]
    return {
        "seconds": statistics.median(tf for _, tf in pairs),
        "baseline_seconds": statistics.median(tb for tb, _ in pairs),
        "ratio_min": min(ratios),
        "ratio": statistics.median(ratios),
        "ratio_max": max(ratios),
    }


def run(args) -> dict:
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    caches, fresh, slots, starts, ends = request(args, device, dtype)

    pin = cuda and not args.pageable  # LMCache's host pool is pinned; --pageable tests staging
    row_copy = {"auto": None, "on": True, "off": False}[args.row_copy]
    whole = PagedKVConnector(caches, row_copy=row_copy)
    layerwise = LayerwisePagedKVConnector(caches, row_copy=row_copy)
    mla = whole.use_mla
    chunk_objs = [
        _memobj(
            whole.get_shape(args.chunk_size),
            dtype,
            MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_2LTD,
            pin,
        )
        for _ in starts
    ]
    layer_objs = [
        [
            _memobj(
                layerwise.get_shape(args.chunk_size),
                dtype,
                MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_T2D,
                pin,
            )
            for _ in starts
        ]
        for _ in range(args.layers)
    ]
    nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in chunk_objs)

    # Baseline: one plain copy_ of the same number of bytes, each direction.
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev_buf.fill_(1)
    host_buf.fill_(2)

    def base_store():
        host_buf.copy_(dev_buf, non_blocking=cuda)

    def base_load():
        dev_buf.copy_(host_buf, non_blocking=cuda)

    def store_whole():
        whole.batched_from_gpu(chunk_objs, starts, ends, kvcaches=caches, slot_mapping=slots)

    def load_whole():
        whole.batched_to_gpu(chunk_objs, starts, ends, kvcaches=fresh, slot_mapping=slots)

    def store_layers():
        for _ in layerwise.batched_from_gpu(
            layer_objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=True
        ):
            pass

    def load_layers():
        gen = layerwise.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
        next(gen)
        for layer in range(args.layers):
            gen.send(layer_objs[layer])
        next(gen)

    results = {}
    for name, fn, base in (
        ("store_whole_chunk", store_whole, base_store),
        ("load_whole_chunk", load_whole, base_load),
        ("store_layerwise", store_layers, base_store),
        ("load_layerwise", load_layers, base_load),
    ):
        r = _paired(fn, base, device, args.repeats)
        results[name] = {
            **r,
            "GBps": nbytes / r["seconds"] / 1e9,
            "baseline_GBps": nbytes / r["baseline_seconds"] / 1e9,
        }

    # Check the figures describe a correct transfer.
    store_whole()
    load_whole()
    if cuda:
        torch.cuda.synchronize(device)
    from kvstore.gpu import PagedKVCache

    assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(caches).gather(slots))

    # Whether whole chunks took the row copy (it needs pinned or device memory objects).
    row_copy_used = whole._copier is not None and whole._copier.accepts([o.tensor for o in chunk_objs])
    if args.profile:
        _profile(
            {"load_layerwise": load_layers, "store_layerwise": store_layers, "store_whole_chunk": store_whole}
        )
        if cuda and row_copy_used:
            for name, fn in (("store_whole_chunk", store_whole), ("load_whole_chunk", load_whole)):
                _row_copy_breakdown(name, fn, nbytes, results[name]["baseline_seconds"])

    overlap = (
        _overlap(args, device, caches, fresh, layerwise, layer_objs, starts, ends, slots) if cuda else None
    )
    return {
        "device": torch.cuda.get_device_name(device)
        if cuda
        else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "bytes_per_pass": nbytes,
        "row_copy": row_copy_used,
        "results": results,
        "layerwise_overlap": overlap,
    }


def _profile(modes: dict[str, Callable[[], None]], calls: int = 20, top: int = 10) -> None:
    """Where the host time of each mode goes (cProfile, own time per function)."""
    import cProfile
    import io
    import pstats

    for name, fn in modes.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        print(f"-- profile {name} ({calls} calls)")
        print("\n".join(lines[2:]))


def _row_copy_breakdown(
    name: str, fn: Callable[[], None], nbytes: int, copy_seconds: float, calls: int = 21
) -> None:
    """Split a whole-chunk call into host time before the row-copy launch, the launch
    itself, the kernel (CUDA events) and the rest (waiting for it, returning); the
    kernel's rate is also given against the run's median plain ``copy_``."""
    import kvstore.gpu.direct as direct

    real: dict[str, Callable[..., None]] = {"copy_paged_rows": direct.copy_paged_rows}
    marks: list[tuple[float, float, torch.cuda.Event, torch.cuda.Event]] = []

    def timing(kernel: Callable[..., None]) -> Callable[..., None]:
        def timed(*a, **kw) -> None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            begin.record()
            kernel(*a, **kw)
            end.record()
            marks.append((t0, time.perf_counter(), begin, end))

        return timed

    for attr, kernel in real.items():
        setattr(direct, attr, timing(kernel))
    try:
        rows = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            stop = time.perf_counter()
            t0, t1, begin, end = marks[-1]
            rows.append((stop - start, t0 - start, t1 - t0, begin.elapsed_time(end) / 1e3))
    finally:
        for attr, kernel in real.items():
            setattr(direct, attr, kernel)
    med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(4)]
    print(
        f"-- {name} breakdown (median of {calls}, ms): call {med[0]:.3f} = before launch {med[1]:.3f} "
        f"+ launch {med[2]:.3f} + rest {med[0] - med[1] - med[2]:.3f}; kernel (events) {med[3]:.3f} "
        f"= {nbytes / med[3] / 1e6:.1f} GB/s, {copy_seconds * 1e3 / med[3]:.2f} of copy_"
    )


def _overlap(args, device, caches, fresh, layerwise, layer_objs, starts, ends, slots) -> dict:
    """Hide layerwise copies behind per-layer compute, as vLLM's forward pass does."""
    n = args.compute_dim
    a = torch.randn(n, n, device=device, dtype=torch.float16)
    b = torch.randn(n, n, device=device, dtype=torch.float16)

    def compute(layer: int) -> None:
        torch.mm(a, b)

    def compute_only():
        for layer in range(args.layers):
            compute(layer)

    def load_only():
        gen = layerwise.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
        next(gen)
        for layer in range(args.layers):
            gen.send(layer_objs[layer])
        next(gen)

    def load_with_compute():
        # Queue layer 0, then: make compute wait for layer i, queue layer i+1, compute i.
        gen = layerwise.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
        next(gen)
        gen.send(layer_objs[0])
        for layer in range(args.layers):
            if layer + 1 < args.layers:
                gen.send(layer_objs[layer + 1])
            else:
                next(gen)
            compute(layer)

    def store_only():
        for _ in layerwise.batched_from_gpu(
            layer_objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=True
        ):
            pass

    def store_with_compute():
        gen = layerwise.batched_from_gpu(
            layer_objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=False
        )
        for layer in range(args.layers):
            compute(layer)  # the layer's attention, then its KV is copied out
            next(gen)
        next(gen)
        layerwise.store_copies.synchronize()

    out = {}
    t_compute = _timed(compute_only, device, args.repeats)
    for name, copy_only, both in (
        ("load", load_only, load_with_compute),
        ("store", store_only, store_with_compute),
    ):
        t_copy = _timed(copy_only, device, args.repeats)
        t_both = _timed(both, device, args.repeats)
        hidden = max(0.0, t_copy + t_compute - t_both)
        out[name] = {
            "compute_s": t_compute,
            "copy_s": t_copy,
            "together_s": t_both,
            "overlap_fraction": hidden / min(t_copy, t_compute),
        }
    return out


def add_geometry(p: argparse.ArgumentParser) -> None:
    """The device and the KV geometry (also read by bench_gpu_layerwise.py)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry(p)
    p.add_argument("--layout", choices=["flash_attn", "flash_infer", "mla"], default="flash_attn")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--compute-dim", type=int, default=4096, help="matmul size standing in for attention (CUDA)"
    )
    p.add_argument(
        "--pageable",
        action="store_true",
        help="memory objects in ordinary (unpinned) host memory: copies go through the staging pool",
    )
    p.add_argument(
        "--row-copy",
        choices=["auto", "on", "off"],
        default="auto",
        help="one-launch row copy (kvstore.gpu.direct): auto = whole chunks on CUDA with Triton; "
        "on = layerwise too; off = gather + DMA",
    )
    p.add_argument("--profile", action="store_true", help="print where the host time of three modes goes")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but no CUDA device is available")

    report = run(args)
    print(f"device: {report['device']}  torch {report['torch']}  threads {report['threads']}")
    print(
        f"bytes per pass: {report['bytes_per_pass'] / 2**20:.1f} MiB ({args.chunks} chunks x {args.chunk_size} tokens), "
        + ("one-launch row copy" if report["row_copy"] else "gather/scatter kernels + copies")
    )
    print(f"{'mode':<20}{'GB/s':>10}{'copy_ GB/s':>12}{'ratio min / median / max':>26}")
    for name, r in report["results"].items():
        ratios = f"{r['ratio_min']:.2f} / {r['ratio']:.2f} / {r['ratio_max']:.2f}"
        print(f"{name:<20}{r['GBps']:>10.2f}{r['baseline_GBps']:>12.2f}{ratios:>26}")
    if report["layerwise_overlap"]:
        for name, o in report["layerwise_overlap"].items():
            print(
                f"layerwise {name} overlap: compute {o['compute_s'] * 1e3:.2f} ms, copy {o['copy_s'] * 1e3:.2f} ms, "
                f"together {o['together_s'] * 1e3:.2f} ms -> {o['overlap_fraction']:.0%} of the shorter hidden"
            )
    else:
        print("layerwise overlap: not measured (needs CUDA)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
