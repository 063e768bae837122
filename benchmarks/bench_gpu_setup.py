"""Where one layerwise pass's time goes on CUDA, step by step (a breakdown, not a ratio).

``bench_gpu_layerwise.py`` says how far a pass is from a plain ``copy_``; this script says
why. It drives ``LayerwisePagedKVConnector`` as LMCache's engine does (sync=True) on the
geometry of ``bench_gpu_connector.py`` and, for each pass:

* stamps the host time spent in each step of a request's set-up and per-layer calls
  (the connector's own methods, the pipeline's plan, the row indices), summed per pass;
* records a timing event on the device after each layer (load: after its scatter, on the
  kernel stream; store: after its copies, on the copy stream), and reports
  ``first_queued`` (host: microseconds from the call to the first layer's queueing),
  ``first_done`` (device: from the call to the first layer complete), the median and
  largest layer, and ``host_late``: how often and for how long the host queued layer i
  after layer i - 1 had already finished on the device (the copy engine idle, waiting
  for the host).

The stamps cost the host ~1 us per wrapped call and the events ~5 us per layer, so the
totals run a little slower than ``bench_gpu_layerwise.py``'s; the split is what it is for.
``--spin`` keeps the host busy for 4 ms before each pass (after the device is idle),
against a CPU that clocks down while ``synchronize`` waits.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/bench_gpu_setup.py [--passes 12] [--spin]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_gpu_connector import _memobj, add_geometry, request
from lmcache.v1.memory_management import MemoryFormat

from kvstore.gpu import pipeline as pipeline_module
from kvstore.gpu.connector import LayerwisePagedKVConnector
from kvstore.gpu.paged import PagedKVCache

_spent: dict[str, float] = {}  # step -> host seconds in this pass


def _stamped(fn: Callable[..., Any], step: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[step] = _spent.get(step, 0.0) + time.perf_counter() - t0

    return call


class _Timing:
    def record(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def elapsed_time(self, other: _Timing) -> float: ...


class _CudaTiming(_Timing):
    """A timing event on the device."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event(enable_timing=True)

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        self._event.record(stream)

    def elapsed_time(self, other: _Timing) -> float:
        assert isinstance(other, _CudaTiming)
        return self._event.elapsed_time(other._event)


class _HostTiming(_Timing):
    """On CPU every step runs inline: the host clock is the device clock."""

    def __init__(self) -> None:
        self._at = 0.0

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        self._at = time.perf_counter()

    def elapsed_time(self, other: _Timing) -> float:
        assert isinstance(other, _HostTiming)
        return (other._at - self._at) * 1e3


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry(p)
    p.add_argument("--passes", type=int, default=12, help="passes per direction (the first two are not counted)")
    p.add_argument("--spin", action="store_true", help="busy host for 4 ms before each pass")
    args = p.parse_args(argv)
    args.layout = "flash_attn"
    torch.set_num_threads(1)
    device, dtype = torch.device(args.device), torch.bfloat16
    cuda = device.type == "cuda"
    caches, fresh, slots, starts, ends = request(args, device, dtype)
    # pipeline=True: what CUDA with pinned objects takes by default; on CPU it runs the
    # same steps inline (a dry run of this script's bookkeeping, no device timing).
    conn = LayerwisePagedKVConnector(caches, row_copy=False, pipeline=True)
    shape = conn.get_shape(args.chunk_size)
    objs = [[_memobj(shape, dtype, MemoryFormat.KV_T2D, cuda) for _ in starts] for _ in range(args.layers)]
    nbytes = objs[0][0].tensor.nbytes * args.layers * len(starts)
    host_all = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev_all = torch.empty(nbytes, dtype=torch.uint8, device=device)
    timing = _CudaTiming if cuda else _HostTiming

    for name in ("_bind", "_sent", "_takes_pipeline", "_driver", "_pipeline", "_pieces", "_addresses", "_hold_while_read"):
        setattr(conn, name, _stamped(getattr(conn, name), "connector." + name))
    PagedKVCache.layer_rows = _stamped(PagedKVCache.layer_rows, "rows: layer_rows")  # type: ignore[method-assign]
    plan_make = pipeline_module.PipelinePlan.make.__func__  # type: ignore[attr-defined]
    pipeline_module.PipelinePlan.make = classmethod(_stamped(plan_make, "pipeline: plan made"))  # type: ignore[method-assign,assignment]
    layers: list[tuple[float, _Timing]] = []  # (host time queued, device event after it)

    def marked(fn: Callable[..., Any], stream: Callable[[], torch.cuda.Stream | None]) -> Callable[..., Any]:
        def call(self: Any, layer: int, *a: Any, **k: Any) -> Any:
            out = fn(self, layer, *a, **k)
            queued = time.perf_counter()
            event = timing()
            event.record(stream())
            layers.append((queued, event))
            return out

        return call

    LayerPipeline = pipeline_module.LayerPipeline
    LayerPipeline.load_layer = marked(LayerPipeline.load_layer, lambda: conn.load_kernels.stream)  # type: ignore[method-assign]
    LayerPipeline.store_layer = marked(LayerPipeline.store_layer, lambda: conn.store_copies.stream)  # type: ignore[method-assign]

    def load() -> None:
        gen = conn.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
        next(gen)
        for li in range(args.layers):
            gen.send(objs[li])
        next(gen)

    def store() -> None:
        for _ in conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=True):
            pass

    directions: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {
        "load": (load, lambda: dev_all.copy_(host_all, non_blocking=True)),
        "store": (store, lambda: host_all.copy_(dev_all, non_blocking=True)),
    }
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run: host timing only)"
    print(f"device: {name}  torch {torch.__version__}  spin={args.spin}")
    for direction, (fn, base) in directions.items():
        rows: list[dict[str, float]] = []
        for _ in range(args.passes):
            b0, b1 = timing(), timing()
            _sync(cuda)
            b0.record()
            base()
            b1.record()
            _sync(cuda)
            _spent.clear()
            layers.clear()
            start, end = timing(), timing()
            if args.spin:
                t = time.perf_counter()
                while time.perf_counter() - t < 0.004:
                    pass
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            _sync(cuda)
            done = [start.elapsed_time(e) * 1e3 for _, e in layers]  # us after the call, device
            queued = [(q - t0) * 1e6 for q, _ in layers]  # us after the call, host
            late = [q - d for q, d in zip(queued[1:], done[:-1]) if q > d]
            steps = [b - a for a, b in itertools.pairwise(done)]
            rows.append(
                {
                    "pass (us)": start.elapsed_time(end) * 1e3,
                    "copy_ of the same bytes (us)": b0.elapsed_time(b1) * 1e3,
                    "first_queued (host)": queued[0],
                    "first_done (device)": done[0],
                    "median layer (device)": statistics.median(steps) if steps else 0.0,
                    "largest layer (device)": max(steps, default=0.0),
                    "host_late layers": float(len(late)),
                    "host_late us": sum(late),
                    **{f"host: {k}": v * 1e6 for k, v in _spent.items()},
                }
            )
        counted = rows[2:] or rows
        print(f"== {direction}: median [min .. max] of {len(counted)} passes, microseconds")
        for key in dict.fromkeys(k for r in counted for k in r):
            vals = [r.get(key, 0.0) for r in counted]
            print(f"  {key:<36}{statistics.median(vals):9.1f}   [{min(vals):.1f} .. {max(vals):.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
