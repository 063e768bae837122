"""The `cachegen` codec: lossy KV compression for bandwidth-bound (cold) tiers.

Owns: tensor <-> cachegen payload.  A KV tensor in LMCache's ``KV_2LTD`` layout
``[2, L, T, H*D]`` (or MLA ``[1, L, T, D]``), float16/bfloat16/float32, becomes:
per-token absmax scales (stored exactly, in the tensor's own dtype), symbols
``round(x * MAX/m + MAX)`` with a per-layer, per-K/V bin count, and a rANS bitstream per
(plane, layer) in which every channel is coded with the cheapest table of a codebook
(one byte per channel per chunk instead of LMCache's 33 int16 per channel).
Decoding needs only the payload plus the codebook set it names (builtin, or a profile
shipped in ``kvstore/codec/profiles``; see `cachegen_profile`).  At LMCache's 32/16
preset the reconstruction equals LMCache's CacheGen bit for bit.

Must not touch: frames (the base class frames payloads), backends, placement.

Options (``kvstore.codec.get("cachegen", ...)``): ``preset="lmcache"`` (32/16 bins),
``profile=PATH|NAME|Profile`` (a calibrated profile; overrides the preset),
``model`` (the model's name, checked against the profile's fingerprint when given),
``num_layers`` (checked against every tensor), ``threads`` (1 or 2 worker threads),
``warm`` (default on: see below).

Warm-up: a process's first call into the numba kernels initialises numba (about 0.3 s of
imports) and loads each kernel from numba's on-disk cache (``__pycache__`` beside
`cachegen_kernels`, or numba's user-wide cache directory when that is read-only; it
compiles, about 2 s, when neither holds it yet), and a codebook set's flattened tables
take 20-30 ms to build.  So that the first chunk a store codes does not pay this,
constructing a codec starts `warm_up` once per process and codebook set on a daemon
thread (off the event loop of whoever opens the store); the first encode or decode waits
for it if it has not finished.  ``warm=0`` skips it (the first call then pays instead).

A profile is bound to its model: encoding refuses (`ProfileMismatchError`, a
`ValueError` naming ``kvstore codec calibrate``) a tensor whose planes, layers or
channels differ from the fingerprint the profile carries.  Presets fit any model.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore.codec.base import Codec, Encoded, dtype_name
from kvstore.codec.cachegen_format import (
    DTYPES,
    CacheGenPayloadError,
    Layout,
    itemsize,
    pack_head,
    parse,
)
from kvstore.codec.cachegen_kernels import (
    LANES,
    PROB_BITS,
    STATE_BYTES,
    decoder_table,
    encode_f32,
    encode_u16,
    encoder_tables,
    rans_decode,
)
from kvstore.codec.cachegen_profile import (
    ModelFingerprint,
    Profile,
    ProfileMismatchError,
    lmcache_bins,
    register,
    resolve,
)
from kvstore.codec.cachegen_tables import CodebookSet, alphabet, bins_to_max, check_bins
from kvstore.frame import FrameHeader

log = logging.getLogger("kvstore.codec")

PRESETS = ("lmcache",)
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="cachegen"
        )
    return _POOL


class _Tables:
    """A codebook set flattened into the kernels' global arrays."""

    def __init__(self, cset: CodebookSet) -> None:
        self.cset = cset
        alphas = sorted(cset.books)
        amax = max(alphas)
        self.base: dict[int, int] = {}
        freq, cum, lut = [], [], []
        n = 0
        for a in alphas:
            b = cset.books[a]
            self.base[a] = n
            n += b.size
            f = np.zeros((b.size, amax), np.uint32)
            f[:, :a] = b.freqs
            c = np.zeros((b.size, amax), np.uint32)
            c[:, :a] = b.cum
            freq.append(f)
            cum.append(c)
            lut.append(b.lut)
        self.freq = np.ascontiguousarray(np.concatenate(freq))
        self.cum = np.ascontiguousarray(np.concatenate(cum))
        self.lut = np.ascontiguousarray(np.concatenate(lut))
        self.enc = encoder_tables(self.freq, self.cum)
        self.fcum = decoder_table(self.freq, self.cum)
        clt = np.zeros((amax, n), np.float32)
        for a in alphas:
            b = cset.books[a]
            clt[:a, self.base[a] : self.base[a] + b.size] = b.codelen.T
        self.clt = np.ascontiguousarray(clt)
        self.size = {a: cset.books[a].size for a in alphas}


_TABLES: dict[tuple[str, int], _Tables] = {}


def _channel_scales(cset: CodebookSet, P: int, L: int, C: int) -> np.ndarray | None:
    """The set's channel scales as [P*L, C] (K first), or None; refuses a shape mismatch."""
    cs = cset.channel_scales
    if cs is None:
        return None
    if cs.shape[1:] != (L, C):
        raise ValueError(
            f"codebook {cset.id!r} has channel scales for {cs.shape[1:]} (layers, channels), tensor has {(L, C)}"
        )
    return np.ascontiguousarray(cs[:P].reshape(P * L, C))


def _tables(cset: CodebookSet) -> _Tables:
    key = (cset.id, cset.digest)
    t = _TABLES.get(key)
    if t is None or t.cset.books.keys() != cset.books.keys():
        t = _TABLES[key] = _Tables(cset)
    return t


_WARM_LOCK = threading.Lock()
_WARM: dict[tuple[object, ...], threading.Thread] = {}


def _warm_key(codec: CacheGenCodec) -> tuple[object, ...]:
    if codec.profile is not None:
        cs = codec.profile.codebooks
        return ("profile", codec.profile.name, None if cs is None else cs.digest, codec.profile.num_layers)
    return ("preset", codec.preset, codec.num_layers)


def _warm_shapes(codec: CacheGenCodec) -> list[tuple[int, int, int, int]]:
    """Tiny tensors that take the codec's own path: its profile's model layout (4 tokens),
    or for a preset enough layers to use both of its bin counts."""
    T = 4
    prof = codec.profile
    if prof is not None and prof.model is not None:
        fp = prof.model
        if not fp.mismatch((fp.planes, fp.num_layers, T, fp.key_channels[0])):
            return [(fp.planes, fp.num_layers, T, fp.key_channels[0])]
    return [(2, codec.num_layers or 10, T, 64)]


def warm_up(codec: CacheGenCodec | None = None) -> None:
    """Do now, in this thread, what a process's first chunk would otherwise pay for:
    initialise numba and load every kernel (from numba's on-disk cache, or compile it),
    build the codec's flattened codebook tables, by coding a few tokens of each dtype
    through `codec` (the preset if None)."""
    c = codec if codec is not None else CacheGenCodec(warm=False)
    if c.profile is not None:
        _tables(c.profile.codebook_set())
    shapes = _warm_shapes(c)
    if c.profile is not None and c.profile.model is None:
        c = CacheGenCodec(num_layers=c.profile.num_layers, warm=False)  # kernels only
        shapes = _warm_shapes(c)
    for shape in shapes:
        x = torch.linspace(-2.0, 2.0, int(np.prod(shape)), dtype=torch.float32).view(shape)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            c.decode(c.encode(x.to(dtype)))


def _warm_in_background(codec: CacheGenCodec) -> threading.Thread | None:
    key = _warm_key(codec)
    with _WARM_LOCK:
        t = _WARM.get(key)
        if t is None:

            def run() -> None:
                try:
                    warm_up(codec)
                except Exception as exc:  # best effort: a real call reports its own error
                    log.warning(
                        "kvstore: cachegen warm-up failed (%s: %s); the first chunk will load the kernels itself",
                        type(exc).__name__,
                        exc,
                    )

            t = _WARM[key] = threading.Thread(target=run, name="cachegen-warm-up", daemon=True)
            t.start()
    return t if t.is_alive() else None


def _join_warm_ups() -> None:
    """Before fork: a child must not inherit numba's compiler lock held by a warm-up."""
    with _WARM_LOCK:
        threads = list(_WARM.values())
    for t in threads:
        if t is not threading.current_thread():
            t.join()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_join_warm_ups)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    cuts = [n * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


class CacheGenCodec(Codec):
    name = "cachegen"

    def __init__(
        self,
        *,
        preset: str = "lmcache",
        profile: str | os.PathLike[str] | Profile | None = None,
        num_layers: int | None = None,
        threads: int = 1,
        model: str | None = None,
        warm: bool | int = True,
    ) -> None:
        if profile is not None:
            self.profile: Profile | None = profile if isinstance(profile, Profile) else Profile.load(profile)
            register(self.profile)
            if num_layers is not None and num_layers != self.profile.num_layers:
                raise ProfileMismatchError(
                    f"profile {self.profile.name!r} is for {self.profile.num_layers} layers, not {num_layers}"
                )
            if model is not None:
                self.profile.check_model_name(str(model))
        elif preset in PRESETS:
            self.profile = None
        else:
            raise ValueError(
                f"unknown cachegen preset {preset!r}; known: {', '.join(PRESETS)} (or pass profile=)"
            )
        self.preset = preset
        self.model = model
        self.num_layers = num_layers if num_layers is None else int(num_layers)
        self.threads = max(1, int(threads))
        self._presets: dict[int, Profile] = {}
        # Set before the warm-up starts: its thread codes through this codec at once, and
        # (when the thread won that race) found no `_warming` yet and failed, so the first
        # chunk loaded the kernels itself.
        self._warming: threading.Thread | None = None
        self._warming = _warm_in_background(self) if int(warm) else None

    def wait_warm(self) -> None:
        """Block until this codec's warm-up (if any is running) has finished."""
        t = self._warming
        if t is not None and t is not threading.current_thread():  # the warm-up's own calls do not wait
            t.join()
            self._warming = None

    # ---- configuration -------------------------------------------------------------

    def profile_for(self, layers: int) -> Profile:
        if self.num_layers is not None and layers != self.num_layers:
            raise ValueError(f"cachegen codec configured for {self.num_layers} layers; tensor has {layers}")
        if self.profile is not None:
            if layers != self.profile.num_layers:
                raise ProfileMismatchError(
                    f"profile {self.profile.name!r} is for {self.profile.num_layers} layers; tensor has {layers}"
                )
            return self.profile
        p = self._presets.get(layers)
        if p is None:
            k, v = lmcache_bins(layers)
            p = self._presets[layers] = Profile(f"{self.preset}-{layers}", k, v)
        return p

    def _run_ranges(self, fn: Callable[..., Any], ranges: list[tuple[int, int]], *args: Any) -> list[Any]:
        """fn(*args, start, s0, s1) per range (the last argument is the list of starts)."""
        *fixed, starts = args
        if len(ranges) == 1:
            return [fn(*fixed, starts[0], *ranges[0])]
        futs = [_pool().submit(fn, *fixed, st, a, b) for st, (a, b) in zip(starts, ranges)]
        return [f.result() for f in futs]

    def _run(self, fn: Callable[..., Any], n: int, *args: Any) -> list[int]:
        if self.threads == 1 or n < 2:
            return [fn(*args, 0, n)]
        futs = [_pool().submit(fn, *args, a, b) for a, b in _split(n, self.threads)]
        return [f.result() for f in futs]

    # ---- encode --------------------------------------------------------------------

    def encode_parts(self, tensor: torch.Tensor, *, layout: str = "KV_2LTD") -> Encoded:
        if self._warming is not None:
            self.wait_warm()
        if tensor.device.type != "cpu":
            raise ValueError("cachegen encodes CPU tensors; copy device tensors to host first")
        if tensor.dim() != 4 or tensor.shape[0] not in (1, 2) or min(tensor.shape) < 1:
            raise ValueError(
                f"cachegen takes [2, L, T, H*D] (KV_2LTD) or [1, L, T, D] (MLA); got {tuple(tensor.shape)}"
            )
        dname = dtype_name(tensor.dtype)
        if dname not in DTYPES:
            raise ValueError(f"cachegen takes float16, bfloat16 or float32; got {dname}")
        P, L, T, C = (int(d) for d in tensor.shape)
        if self.num_layers is not None and self.num_layers != L:
            raise ValueError(f"cachegen codec configured for {self.num_layers} layers; tensor has {L}")
        if self.profile is not None:
            self.profile.check_tensor((P, L, T, C))
        prof = self.profile_for(L)
        cset = prof.codebook_set()
        tabs = _tables(cset)
        bins = np.array([prof.key_bins, prof.value_bins][:P], dtype=np.uint8)  # [P, L]
        S = P * L
        flat_bins = bins.reshape(S)
        maxq = np.array([bins_to_max(int(b)) for b in flat_bins], dtype=np.int32)
        alphas = np.array([alphabet(int(b)) for b in flat_bins])

        x = tensor.contiguous().view(S, T, C)
        # The first R tokens of every stream are stored verbatim (a profile's raw_tokens:
        # the attention sink at the start of a sequence is worth its 16 bits).
        R = min(prof.raw_tokens, T)
        Tc = T - R
        scales = np.empty((S, Tc), np.float32)
        chs = _channel_scales(cset, P, L, C)
        inv = np.ones((S, C), np.float32) if chs is None else (np.float32(1.0) / chs)
        base = np.array([tabs.base[int(a)] for a in alphas], np.int64)
        ksize = np.array([tabs.size[int(a)] for a in alphas], np.int64)
        gtab = np.empty((S, C), np.int32)
        lengths = np.empty(S, np.int64)
        xk: np.ndarray
        if tensor.dtype == torch.float32:
            kernel, xk, bf16 = encode_f32, x.numpy(), 0
        else:
            kernel, xk, bf16 = (
                encode_u16,
                x.view(torch.int16).numpy().view(np.uint16),
                int(tensor.dtype == torch.bfloat16),
            )
        # One buffer for the whole payload, sized for the worst case (streams of 2 bytes
        # a symbol); only the pages written are ever touched.
        if R and not bool(torch.isfinite(x[:, :R]).all()):
            bad = int(torch.nonzero(~torch.isfinite(x[:, :R]))[0, 0])
            raise ValueError(f"cachegen cannot encode inf/NaN (plane {bad // L}, layer {bad % L})")
        raw = np.ascontiguousarray(xk[:, :R]).reshape(-1).view(np.uint8) if R else np.empty(0, np.uint8)
        head = pack_head(
            Layout(P, L, T, C, dname, dname, PROB_BITS, LANES, cset.id, cset.digest, chs is not None, R)
        )
        cap = STATE_BYTES + 2 * Tc * C
        # Scales are stored in the tensor's dtype: exact without channel scales (they are
        # input magnitudes); with them, rounded up before quantizing, float32 on overflow.
        sdtype = tensor.dtype
        for _ in range(2):
            mode = 0 if chs is None or sdtype == torch.float32 else (1 if sdtype == torch.float16 else 2)
            o_streams = len(head) + S + S * C + 4 * S + S * Tc * itemsize(dtype_name(sdtype)) + raw.size
            out = np.empty(o_streams + S * cap, np.uint8)
            ranges = _split(S, self.threads if S > 1 else 1)
            res = self._run_ranges(
                kernel,
                ranges,
                xk,
                R,
                bf16,
                inv,
                mode,
                maxq,
                scales,
                alphas.astype(np.int64),
                base,
                ksize,
                tabs.clt,
                tabs.enc,
                gtab,
                lengths,
                out,
                [o_streams + a * cap for a, _ in ranges],
            )
            if all(r != -2 for r, _ in res):
                break
            sdtype = torch.float32
        if any(r >= 0 for r, _ in res):
            s = next(r for r, _ in res if r >= 0)
            raise ValueError(f"cachegen cannot encode inf/NaN (plane {s // L}, layer {s % L})")
        choice = (gtab - base[:, None]).astype(np.uint8)

        sc = torch.from_numpy(scales).to(sdtype)
        sc_bytes = sc.view(torch.uint8).numpy() if sdtype == torch.float32 else sc.view(torch.int16).numpy()
        sname = dtype_name(sdtype)
        lay = Layout(P, L, T, C, dname, sname, PROB_BITS, LANES, cset.id, cset.digest, chs is not None, R)
        head = pack_head(lay)
        nstream = int(lengths.sum())
        o = len(head) + S + S * C + 4 * S + S * Tc * itemsize(sname) + raw.size
        size = o + nstream
        # Streams were coded right after the scales, or with several threads, each range
        # at its worst-case offset: close the gaps (numpy copies overlapping ranges right).
        for (a, _), (_, end) in zip(ranges, res):
            src = o_streams + a * cap
            n = end - src
            if src != o:
                out[o : o + n] = out[src:end]
            o += n
        assert o == size
        o = 0
        for part in (
            np.frombuffer(head, np.uint8),
            flat_bins,
            choice.reshape(-1),
            lengths.astype("<u4").view(np.uint8),
            sc_bytes.reshape(-1).view(np.uint8),
            raw,
        ):
            out[o : o + part.size] = part
            o += part.size
        return Encoded(
            parts=[out[:size].data],
            dtype=dname,
            shape=(P, L, T, C),
            layout=layout,
            meta={"profile": prof.name},
        )

    # ---- decode --------------------------------------------------------------------

    def decode_payload(
        self, payload: memoryview, header: FrameHeader, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._warming is not None:
            self.wait_warm()
        sec = parse(payload)
        lay = sec.layout
        shape = (lay.planes, lay.layers, lay.tokens, lay.channels)
        if tuple(header.shape) != shape or header.dtype != lay.dtype:
            raise CacheGenPayloadError(
                f"frame says {tuple(header.shape)} {header.dtype}; payload holds {shape} {lay.dtype}"
            )
        if lay.prob_bits != PROB_BITS or lay.lanes != LANES:
            raise CacheGenPayloadError("cachegen payload uses coder parameters this kvstore does not know")
        S = lay.streams
        flat_bins = sec.bins.reshape(S).astype(np.int64)
        if (flat_bins < 4).any():
            raise CacheGenPayloadError("cachegen payload has a bin count below 4")
        alphas = 2 * (flat_bins // 2 - 1) + 1
        cset = resolve(lay.codebook_id, lay.codebook_digest, sorted({int(a) for a in alphas}))
        tabs = _tables(cset)
        choice = sec.tables.reshape(S, lay.channels).astype(np.int32)
        gtab = np.empty_like(choice)
        vals_parts, vbase, vb = [], np.empty(S, np.int64), 0
        vcache: dict[int, int] = {}
        for s in range(S):
            a = int(alphas[s])
            try:
                book = cset.book(a)
            except ValueError as exc:
                raise CacheGenPayloadError(f"cachegen stream {s}: {exc}") from exc
            if int(choice[s].max()) >= book.size:
                raise CacheGenPayloadError(f"cachegen stream {s} names a table beyond its codebook")
            gtab[s] = choice[s] + tabs.base[a]
            if a not in vcache:
                mx = np.float32(a // 2)
                vals_parts.append((np.arange(a, dtype=np.float32) - mx) / mx)
                vcache[a] = vb
                vb += a
            vbase[s] = vcache[a]
        vals = np.concatenate(vals_parts)

        sdt = getattr(torch, lay.scale_dtype)
        sraw = (  # empty when every token is raw
            torch.frombuffer(bytearray(sec.scales), dtype=torch.uint8)
            if sec.scales
            else torch.empty(0, dtype=torch.uint8)
        )
        sc = sraw.view(sdt).float().view(S, lay.coded_tokens)
        if not bool(torch.isfinite(sc).all()) or bool((sc < 0).any()):
            raise CacheGenPayloadError("cachegen payload has a negative or non-finite scale")
        offs = np.zeros(S + 1, np.int64)
        np.cumsum(sec.stream_bytes, out=offs[1:])
        data = np.frombuffer(sec.streams, dtype=np.uint8)
        if data.flags.writeable:  # one kernel signature (and one cache entry) for every buffer
            data = data.view()
            data.flags.writeable = False
        dtype = getattr(torch, lay.dtype)
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != dtype:
                raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; frame holds {shape} {dtype}")
            result = out
        else:
            result = torch.empty(shape, dtype=dtype)
        scn = sc.numpy()
        try:
            chs = _channel_scales(cset, lay.planes, lay.layers, lay.channels) if lay.channel_scaled else None
        except ValueError as exc:
            raise CacheGenPayloadError(str(exc)) from exc
        if lay.channel_scaled and chs is None:
            raise CacheGenPayloadError(f"payload uses channel scales that codebook {cset.id!r} does not have")
        if chs is None:
            chs = np.ones((S, lay.channels), np.float32)

        # The kernel writes the result's own dtype straight into a contiguous CPU tensor
        # (float16/bfloat16 rounded as torch rounds); anything else gets a float32 decode
        # and a copy.
        mode = {"float32": 0, "float16": 1, "bfloat16": 2}[lay.dtype]
        direct = result.device.type == "cpu" and result.is_contiguous() and not result.requires_grad
        if direct:
            flat = result.view(S, lay.tokens, lay.channels)
            dst = flat.numpy() if mode == 0 else flat.view(torch.int16).numpy().view(np.uint16)
        else:
            mode = 0
            dst = np.empty((S, lay.tokens, lay.channels), np.float32)

        R = lay.raw_tokens
        if R:
            rt = torch.frombuffer(bytearray(sec.raw), dtype=dtype).view(S, R, lay.channels)
            if not bool(torch.isfinite(rt).all()):
                raise CacheGenPayloadError("cachegen payload has a non-finite raw token")
            if mode == 0:
                dst[:, :R] = rt.float().numpy() if dtype != torch.float32 else rt.numpy()
            else:
                dst[:, :R] = rt.view(torch.int16).numpy().view(np.uint16)

        def work(s0: int, s1: int) -> int:
            return rans_decode(
                data, offs, gtab, tabs.fcum, tabs.lut, vals, vbase, scn, chs, dst, R, mode, s0, s1
            )

        bad = self._run(work, S)
        if any(b >= 0 for b in bad):
            s = next(b for b in bad if b >= 0)
            raise CacheGenPayloadError(f"cachegen stream {s} is malformed (truncated or corrupt)")
        if not direct:
            result.copy_(torch.from_numpy(dst).view(shape))
        return result


__all__ = [
    "CacheGenCodec",
    "CacheGenPayloadError",
    "ModelFingerprint",
    "Profile",
    "ProfileMismatchError",
    "check_bins",
    "warm_up",
]
