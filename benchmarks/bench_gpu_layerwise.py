"""Benchmark: what bounds a layerwise pass on CUDA, and where its time goes.

A layerwise pass moves L x N pieces: LMCache allocates one memory object per layer and
chunk, so whatever moves the bytes, a DMA path issues one copy per piece. This script
times, interleaved in one process on the geometry of ``bench_gpu_connector.py``:

``copy_``       one pinned <-> device copy of all the bytes (the goal's baseline);
``pieces``      the same bytes as L x N copies between one device buffer and the memory
                objects, back to back on one stream, no gather, no events, no waits: the
                floor of any DMA path over LMCache's objects;
``pieces/2``    the same, alternating two streams (copy engines overlap their set-up);
``minimal``     a gather (store) / scatter (load) per layer plus the N copies on one
                stream, written as plainly as torch allows, with the connector's ordering
                (store: layer i is queued before layer i-1 is waited for; load: compute
                waits per layer);
``connector``   ``LayerwisePagedKVConnector`` as LMCache's engine drives it (sync=True):
                the two-stream pipeline of ``kvstore.gpu.pipeline``;
``connector, primed``  (load) the same timed from the first objects sent: the
                generator's first step, which LMCache's engine takes before it fetches
                the first layer from storage, is taken before the clock starts;
``connector, sync=False``  the same with no host waits between layers;
``connector, one stream``  the same with ``pipeline=False`` (gather/scatter and copies on
                one stream, the path before the pipeline);
``connector, 2 in turn``  two requests stepped one layer of each at a time, as LMCache's
                vLLM adapter steps a batch (one with sync=True), against two ``copy_``;
``issue only``  the connector with sync=False, host time only (a load's includes its
                final wait for the last layer).

and the host cost (median microseconds) of each call a layer makes, the driver calls the
pipeline makes instead of torch's, and a request's set-up (until its first layer is
queued). Ratios are ``t(copy_) / t(mode)`` per interleaved pair, min / median / max.
``--trace DIR`` also writes a chrome trace of one pass of ``pieces`` and the connector per
direction and prints how long the copy engine sat idle between copies, and how much of
that next to a gather or scatter kernel.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/bench_gpu_layerwise.py [--repeats 21] [--json F] [--trace DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Generator
from typing import Any

import torch
from bench_gpu_connector import _memobj, add_geometry, request
from lmcache.v1.memory_management import MemoryFormat

from kvstore.gpu import PagedKVCache
from kvstore.gpu.connector import LayerwisePagedKVConnector
from kvstore.gpu.driver import driver_calls


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _once(fn: Callable[[], None], cuda: bool) -> float:
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:  # a step the mode takes before the clock starts
        prepare()
    _sync(cuda)
    t0 = time.perf_counter()
    fn()
    _sync(cuda)
    return time.perf_counter() - t0


def _host_us(fn: Callable[[], object], cuda: bool, calls: int = 200) -> float:
    """Median host microseconds of one call (device work drained between batches)."""
    samples = []
    for _ in range(5):
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        _sync(cuda)
    return statistics.median(samples)


def _started(gen: Generator[None, Any, None]) -> Generator[None, Any, None]:
    next(gen)
    return gen


def _first_layer_us(
    start: Callable[[], Generator[None, Any, None]],
    finish: Callable[[Generator[None, Any, None]], object],
    repeats: int = 21,
) -> float:
    """Median host microseconds of ``start()`` (a request's set-up and its first layer
    queued, CUDA), the rest of the request finished by ``finish`` outside the clock."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = start()
        samples.append(time.perf_counter() - t0)
        finish(gen)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def _copy_gaps(path: str) -> dict[str, float]:
    """From a chrome trace of one pass: the copies' span, how long the copy engine was
    busy, and the idle time between consecutive copies (all of it, and the part where a
    kernel ran in the gap) in microseconds."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not copies:
        return {}
    busy = sum(e["dur"] for e in copies)
    span = copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in itertools.pairwise(copies)]
    with_kernel = 0.0
    for (a, b), g in zip(itertools.pairwise(copies), gaps, strict=True):
        lo, hi = a["ts"] + a["dur"], b["ts"]
        if any(lo <= k["ts"] + k["dur"] and k["ts"] <= hi for k in kernels):
            with_kernel += g
    big = sorted(gaps)[-5:]
    return {
        "copies": len(copies),
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "idle_next_to_kernel_us": with_kernel,
        "median_gap_us": statistics.median(gaps) if gaps else 0.0,
        "largest_gaps_us": big,  # type: ignore[dict-item]
        "median_copy_us": statistics.median(e["dur"] for e in copies),
    }


def _trace(folder: str, fns: dict[str, Callable[[], None]]) -> dict[str, dict[str, float]]:
    """One profiled pass of each of ``fns`` (after a warm one), its chrome trace written
    to ``folder``, and the copy engine's busy and idle time printed."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    out = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        path = os.path.join(folder, name.replace(" ", "_") + ".json")
        prof.export_chrome_trace(path)
        out[name] = gaps = _copy_gaps(path)
        print(
            f"trace {name:<17} {gaps.get('copies', 0):4.0f} copies  span {gaps.get('span_us', 0):8.1f} us  "
            f"busy {gaps.get('busy_us', 0):8.1f}  idle {gaps.get('idle_us', 0):7.1f} "
            f"(next to a kernel {gaps.get('idle_next_to_kernel_us', 0):7.1f})  median gap "
            f"{gaps.get('median_gap_us', 0):5.1f}  largest {gaps.get('largest_gaps_us')}  "
            f"median copy {gaps.get('median_copy_us', 0):5.1f} us"
        )
    return out


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    caches, fresh, slots, starts, ends = request(args, device, dtype)
    tokens = args.chunks * args.chunk_size
    conn = LayerwisePagedKVConnector(caches, row_copy=False)
    single = LayerwisePagedKVConnector(caches, row_copy=False, pipeline=False)
    shape = conn.get_shape(args.chunk_size)
    objs = [[_memobj(shape, dtype, MemoryFormat.KV_T2D, cuda) for _ in starts] for _ in range(args.layers)]
    hosts = [[o.tensor for o in layer] for layer in objs]
    piece = hosts[0][0].numel() * hosts[0][0].element_size()
    nbytes = piece * args.layers * args.chunks
    dev_all = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host_all = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(2)
    dev_pieces = [
        [
            dev_all[(li * args.chunks + c) * piece : (li * args.chunks + c + 1) * piece]
            .view(dtype)
            .view(shape)
            for c in range(args.chunks)
        ]
        for li in range(args.layers)
    ]
    side = torch.cuda.Stream() if cuda else None
    main = torch.cuda.current_stream() if cuda else None

    # -- modes -------------------------------------------------------------------------
    def copy_store():
        host_all.copy_(dev_all, non_blocking=cuda)

    def copy_load():
        dev_all.copy_(host_all, non_blocking=cuda)

    def pieces(to_host: bool, two: bool) -> Callable[[], None]:
        def go():
            if two and cuda:
                assert side is not None and main is not None
                side.wait_stream(main)
            for li in range(args.layers):
                for c in range(args.chunks):
                    h, d = hosts[li][c], dev_pieces[li][c]
                    if two and cuda and c % 2:
                        with torch.cuda.stream(side):
                            (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
                    else:
                        h.copy_(d, non_blocking=cuda) if to_host else d.copy_(h, non_blocking=cuda)
            if two and cuda:
                assert main is not None
                main.wait_stream(side)

        return go

    # The minimal gather + copies path, rows and views made once per pass as the connector
    # makes them once per request.
    paged = conn.paged
    assert paged is not None
    fresh_paged = PagedKVCache(fresh)

    def minimal_store():
        rows = paged.layer_rows(slots)
        scratch = torch.empty(paged.layout.layer_chunk_shape(tokens), dtype=dtype, device=device)
        words = paged.layer_words(scratch, tokens)
        views = [scratch[s:e] for s, e in zip(starts, ends, strict=True)]
        stream = side if cuda else None
        previous = None
        for li in range(args.layers):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                ctx = torch.cuda.stream(stream)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                paged.gather_words(li, rows, words)
                for h, v in zip(hosts[li], views, strict=True):
                    h.copy_(v, non_blocking=cuda)
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record()
            if previous is not None:
                previous.synchronize()
            previous = event
        if previous is not None:
            previous.synchronize()

    def minimal_load():
        rows = paged.layer_rows(slots)
        scratch = torch.empty(paged.layout.layer_chunk_shape(tokens), dtype=dtype, device=device)
        words = fresh_paged.layer_words(scratch, tokens)
        views = [scratch[s:e] for s, e in zip(starts, ends, strict=True)]
        for li in range(args.layers):
            if cuda:
                assert side is not None
                torch.cuda.current_stream().wait_stream(side)
                ctx = torch.cuda.stream(side)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                for h, v in zip(hosts[li], views, strict=True):
                    v.copy_(h, non_blocking=cuda)
                fresh_paged.scatter_words(li, rows, words)
        if cuda:
            assert side is not None
            torch.cuda.current_stream().wait_stream(side)
            side.synchronize()

    def conn_store(sync: bool = True, c: LayerwisePagedKVConnector = conn):
        for _ in c.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=sync):
            pass

    def conn_load(sync: bool = True, c: LayerwisePagedKVConnector = conn):
        gen = c.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=sync)
        next(gen)
        for li in range(args.layers):
            gen.send(objs[li])
        next(gen)

    class PrimedLoad:
        """The load from its first objects on: the generator's first step (``next()``),
        which LMCache's engine takes before it fetches the first layer from storage, is
        taken before the clock starts (``prepare``)."""

        def __init__(self) -> None:
            self.gen: Generator[None, Any, None] | None = None

        def prepare(self) -> None:
            self.gen = conn.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
            next(self.gen)

        def __call__(self) -> None:
            if self.gen is None:
                self.prepare()
            gen, self.gen = self.gen, None
            assert gen is not None
            for li in range(args.layers):
                gen.send(objs[li])
            next(gen)

    # Two requests stepped in turn, as LMCache's vLLM adapter steps a batch: one layer of
    # each at a time, one request with sync=True (the store's first, the load's last);
    # timed against two copy_ of one request's bytes each.
    objs_b = [[_memobj(shape, dtype, MemoryFormat.KV_T2D, cuda) for _ in starts] for _ in range(args.layers)]

    def conn_store_two():
        gens = [
            conn.batched_from_gpu(o, starts, ends, kvcaches=caches, slot_mapping=slots, sync=i == 0)
            for i, o in enumerate((objs, objs_b))
        ]
        for _ in range(args.layers + 1):
            for gen in gens:
                next(gen)

    def conn_load_two():
        gens = []
        for i, o in enumerate((objs, objs_b)):
            gen = conn.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=i == 1)
            next(gen)
            gens.append((gen, o))
        for li in range(args.layers):
            for gen, o in gens:
                gen.send(o[li])
        for gen, _ in gens:
            next(gen)

    modes = {
        "store": (
            copy_store,
            {
                "pieces": pieces(True, False),
                "pieces/2": pieces(True, True),
                "minimal": minimal_store,
                "connector": conn_store,
                "connector, sync=False": lambda: conn_store(False),
                "connector, one stream": lambda: conn_store(True, single),
                "connector, 2 in turn": conn_store_two,
            },
        ),
        "load": (
            copy_load,
            {
                "pieces": pieces(False, False),
                "pieces/2": pieces(False, True),
                "minimal": minimal_load,
                "connector": conn_load,
                "connector, primed": PrimedLoad(),
                "connector, sync=False": lambda: conn_load(False),
                "connector, one stream": lambda: conn_load(True, single),
                "connector, 2 in turn": conn_load_two,
            },
        ),
    }
    twice = {"connector, 2 in turn"}  # modes that move two requests' bytes
    results: dict[str, dict[str, dict[str, float]]] = {}
    for direction, (base, fns) in modes.items():
        for fn in (base, *fns.values()):
            fn(), fn()
        pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                baseline = (lambda b=base: (b(), b())) if name in twice else base
                pairs[name].append((_once(baseline, cuda), _once(fn, cuda)))
        results[direction] = {}
        for name, ps in pairs.items():
            ratios = [b / f for b, f in ps]
            results[direction][name] = {
                "ms": statistics.median(f for _, f in ps) * 1e3,
                "copy_ms": statistics.median(b for b, _ in ps) * 1e3,
                "ratio_min": min(ratios),
                "ratio": statistics.median(ratios),
                "ratio_max": max(ratios),
            }
        # Host time of the connector's calls alone (sync=False queues without waiting).
        issue = conn_store if direction == "store" else conn_load
        t = []
        for _ in range(args.repeats):
            _sync(cuda)
            t0 = time.perf_counter()
            issue(False)
            t.append(time.perf_counter() - t0)
            _sync(cuda)
        results[direction]["connector issue only (host)"] = {"ms": statistics.median(t) * 1e3}

    # Correctness of what was timed: the loads wrote what the stores read.
    conn_store()
    fresh_copy = [torch.zeros_like(c) for c in caches]
    gen = conn.batched_to_gpu(starts, ends, kvcaches=fresh_copy, slot_mapping=slots, sync=True)
    next(gen)
    for li in range(args.layers):
        gen.send(objs[li])
    next(gen)
    _sync(cuda)
    assert torch.equal(PagedKVCache(fresh_copy).gather(slots), PagedKVCache(caches).gather(slots))

    traces: dict[str, dict[str, float]] = {}
    if cuda and args.trace:
        traces = _trace(
            args.trace,
            {
                "store pieces": pieces(True, False),
                "store connector": conn_store,
                "store sync=False": lambda: conn_store(False),
                "load pieces": pieces(False, False),
                "load connector": conn_load,
                "load sync=False": lambda: conn_load(False),
            },
        )

    # -- host cost per call ----------------------------------------------------------
    host: dict[str, float] = {}
    if cuda:
        assert side is not None
        rows = paged.layer_rows(slots)
        scratch = torch.empty(paged.layout.layer_chunk_shape(tokens), dtype=dtype, device=device)
        words = paged.layer_words(scratch, tokens)
        done = torch.cuda.Event()
        done.record()
        h, d = hosts[0][0], dev_pieces[0][0]
        host["Event() + record"] = _host_us(lambda: torch.cuda.Event().record(), cuda)
        host["stream.wait_stream(current)"] = _host_us(
            lambda: side.wait_stream(torch.cuda.current_stream()), cuda
        )
        host["with torch.cuda.stream(s)"] = _host_us(
            lambda: torch.cuda.stream(side).__enter__() and None, cuda
        )
        host["index_select(out=) one layer"] = _host_us(lambda: paged.gather_words(0, rows, words), cuda)
        host["index_copy_ one layer"] = _host_us(lambda: fresh_paged.scatter_words(0, rows, words), cuda)
        host["copy_ 1 piece D2H"] = _host_us(lambda: h.copy_(d, non_blocking=True), cuda)
        host["copy_ 1 piece H2D"] = _host_us(lambda: d.copy_(h, non_blocking=True), cuda)
        host["set_stream(s) + set_stream(cur)"] = _host_us(
            lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(torch.cuda.default_stream())), cuda
        )
        ev = torch.cuda.Event()
        ev.record()
        host["existing event.record()"] = _host_us(ev.record, cuda)
        host["stream.wait_event(ev)"] = _host_us(lambda: side.wait_event(ev), cuda)
        host["connector store: request set-up + layer 0 queued"] = _first_layer_us(
            lambda: _started(conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=False)),
            lambda gen: [None for _ in gen],
        )

        def load_started():
            gen = conn.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=False)
            next(gen)
            gen.send(objs[0])
            return gen

        def load_finish(gen):
            for li in range(1, args.layers):
                gen.send(objs[li])
            next(gen)

        host["connector load: request set-up + layer 0 queued"] = _first_layer_us(load_started, load_finish)
        chunks = len(starts)
        host["request rows: layer_rows(slot_mapping)"] = _host_us(lambda: paged.layer_rows(slots), cuda)
        host["pipeline set-up, store (rows made)"] = _host_us(
            lambda: conn._pipeline(paged, slots, starts, ends, [0] * chunks, store=True), cuda
        )
        host["pipeline set-up, load (rows deferred)"] = _host_us(
            lambda: conn._pipeline(paged, slots, starts, ends, [0] * chunks, store=False), cuda
        )
        host["obj.tensor (LMCache)"] = _host_us(lambda: objs[0][0].tensor, cuda)
        host["obj.metadata + obj.data_ptr (LMCache)"] = _host_us(
            lambda: (objs[0][0].metadata, objs[0][0].data_ptr), cuda
        )
        drv = driver_calls(torch.cuda.current_device())
        if drv is not None:
            dp, hp, n = d.data_ptr(), h.data_ptr(), h.numel() * h.element_size()
            sh, eh = side.cuda_stream, ev.cuda_event
            host["driver: cuMemcpyAsync 1 piece H2D"] = _host_us(lambda: drv.copy(dp, hp, n, sh), cuda)
            host["driver: cuEventRecord"] = _host_us(lambda: drv.record(eh, sh), cuda)
            host["driver: cuStreamWaitEvent"] = _host_us(lambda: drv.wait(sh, eh), cuda)
        host["is_pinned()"] = _host_us(h.is_pinned, cuda)
        host["completed event.synchronize()"] = _host_us(done.synchronize, cuda)
        host["scratch[a:b] slice"] = _host_us(lambda: scratch[256:512], cuda)
        torch.cuda.set_stream(torch.cuda.default_stream())
        if args.profile:
            import cProfile
            import pstats

            for name, fn in (("store", lambda: conn_store(False)), ("load", lambda: conn_load(False))):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                print(f"-- profile: connector {name}, 10 passes, sync=False")
                pstats.Stats(prof).sort_stats("tottime").print_stats(28)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "bytes_per_pass": nbytes,
        "piece_bytes": piece,
        "pieces": args.layers * args.chunks,
        "results": results,
        "host_us": host,
        "trace": traces,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry(p)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--profile", action="store_true", help="cProfile the connector's passes (CUDA)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--trace", help="CUDA: write a chrome trace of one pass of each mode to this folder")
    args = p.parse_args(argv)
    args.layout = "flash_attn"
    report = run(args)
    print(f"device: {report['device']}  torch {report['torch']}")
    print(
        f"{report['bytes_per_pass'] / 2**20:.0f} MiB per pass as {report['pieces']} pieces of "
        f"{report['piece_bytes'] / 2**20:.2f} MiB"
    )
    print(f"{'direction / mode':<28}{'ms':>8}{'copy_ ms':>10}{'ratio min / median / max':>28}")
    for direction, modes in report["results"].items():
        for name, r in modes.items():
            if "ratio" in r:
                ratios = f"{r['ratio_min']:.2f} / {r['ratio']:.2f} / {r['ratio_max']:.2f}"
                print(f"{direction + ' ' + name:<28}{r['ms']:>8.3f}{r['copy_ms']:>10.3f}{ratios:>28}")
            else:
                print(f"{direction + ' ' + name:<28}{r['ms']:>8.3f}")
    for name, us in report["host_us"].items():
        print(f"host  {name:<36}{us:>8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
