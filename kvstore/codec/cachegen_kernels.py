"""Numba kernels of the `cachegen` codec: per-token absmax quantization and 4-lane rANS.

Owns: the inner loops only (no I/O, no format, no tensors).  Every kernel releases the
GIL (``nogil=True``) and works on a half-open range of streams ``[s0, s1)`` so callers
can split one chunk across threads.  A *stream* is one (plane, layer) slice ``[T, C]``;
its symbols are coded channel-major (all tokens of channel 0, then channel 1, ...),
each channel with its own frequency table, lanes interleaved by symbol index mod 4.

rANS parameters: 31-bit states in ``[RANS_L, 2**31)``, 16-bit renormalisation words
(little endian), probabilities with ``PROB_BITS`` bits.  A coded stream is
``4 x u32 final states`` followed by the renormalisation words in decode order.

The quantizer reproduces LMCache's CacheGen arithmetic in float32:
``q = rint(x * (MAX / m) + MAX)`` with ``m = max|x|`` per token, and dequantization
``((q - MAX) / MAX) * m`` (the first factor comes from a per-bin table).

Indexing: numba wraps a negative signed index around (a compare and a select on every
access, and loops it will not vectorize); an unsigned one it uses as it is.  The hot
loops index with ``_u(i)`` where ``i >= 0`` by construction, and walk flat views with
offsets they compute themselves: the rANS coders take 30-45% less time so, bit-identically.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvstore.codec.prefetch import prefetch

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 15
LANES = 4
STATE_BYTES = 4 * LANES
assert LANES == 4, "rans_encode / rans_decode keep one local per lane (w0..w3)"
_u = np.uint64  # an index known to be >= 0 (see the module docstring)
F16_TO_F32 = np.float32(5.192296858534828e33)  # 2**112: float16 exponent bias -> float32's


@njit(nogil=True, cache=True, inline="always")
def _quant_row(row, m, mx, qf, qb, hf, hb, a_n):
    """Quantize one token's channels (float32 `row`, absmax `m`) into qf[qb:qb+C] and
    count the symbols in hf[hb + c * a_n + symbol] (flat views: no per-row slices, whose
    reference counting cost more than the row's arithmetic)."""
    n = row.shape[0]
    fmx = np.float32(mx)
    top = 2 * mx
    if m == np.float32(0.0):
        for c in range(n):
            qf[_u(qb + c)] = mx
    else:
        f = fmx / m
        if f == np.inf:
            # m is subnormal: MAX / m overflows float32; divide in float64 instead.
            dm = np.float64(m)
            for c in range(n):
                qi = int(np.rint(np.float64(row[_u(c)]) / dm * mx + mx))
                qf[_u(qb + c)] = min(max(qi, 0), top)
        else:
            for c in range(n):
                t = row[_u(c)] * f
                qi = np.int32(np.rint(t + fmx))
                qf[_u(qb + c)] = min(max(qi, 0), top)
    for c in range(n):
        hf[_u(hb + c * a_n + np.int64(qf[_u(qb + c)]))] += 1


@njit(nogil=True, cache=True, inline="always")
def _absmax(rowbits):
    """(max |row|, ok) of a float32 row given as its bits: magnitudes of finite floats
    order like their bits with the sign cleared, and those bits are the magnitude's own
    (one vectorizable pass, no search for the element that holds it)."""
    mb = np.int32(0)
    for c in range(rowbits.shape[0]):
        mb = max(mb, rowbits[_u(c)] & 0x7FFFFFFF)
    if mb >= 0x7F800000:
        return np.float32(0.0), False
    return np.int32(mb).view(np.float32), True


@njit(nogil=True, cache=True, inline="always")
def _round_scale(m, mode):
    """Round a float32 scale up to what the payload stores: mode 0 keeps float32 (or an
    already exact value), 1 float16, 2 bfloat16.  Returns inf if float16 overflows."""
    if mode == 0 or m == np.float32(0.0):
        return m
    if mode == 1:
        if m > np.float32(65504.0):
            return np.float32(np.inf)
        if m < np.float32(6.103515625e-05):  # float16 subnormal range: steps of 2**-24
            step = np.float32(5.960464477539063e-08)
            return np.float32(np.ceil(m / step)) * step
        low = np.int32(0x1FFF)
    else:
        low = np.int32(0xFFFF)
    bits = np.float32(m).view(np.int32)
    if bits & low:
        bits = (bits | low) + np.int32(1)
    r = np.int32(bits).view(np.float32)
    if mode == 1 and r > np.float32(65504.0):
        return np.float32(np.inf)
    return r


@njit(nogil=True, cache=True, inline="always")
def _quantize_rows(row, rowbits, s, t0, T, mode, maxq, q, scales, hist, xf, invf, kind):
    """The rows of stream s (tokens t0..T-1): widen (`kind` 0 float32, 1 float16, 2
    bfloat16), scale by the channel factors, absmax, round the scale, quantize, count.
    Returns -1, or s for inf/NaN, or -2 for a float16 scale that overflows."""
    C = row.shape[0]
    a_n = hist.shape[2]
    qf = q.reshape(-1)
    hf = hist.reshape(-1)
    mx = maxq[s]
    hb = s * C * a_n
    for i in range(C * a_n):
        hf[_u(hb + i)] = 0
    ib = s * C
    for t in range(t0, T):
        xb = (s * T + t) * C
        if kind == 0:
            for c in range(C):
                row[_u(c)] = xf[_u(xb + c)] * invf[_u(ib + c)]
        elif kind == 2:
            for c in range(C):
                row[_u(c)] = (
                    np.uint32(np.uint32(xf[_u(xb + c)]) << np.uint32(16)).view(np.float32) * invf[_u(ib + c)]
                )
        else:
            for c in range(C):
                row[_u(c)] = _f16_value(np.uint32(xf[_u(xb + c)])) * invf[_u(ib + c)]
        m, ok = _absmax(rowbits)
        if not ok:
            return s
        m = _round_scale(m, mode)
        if m == np.inf:
            return -2
        scales[s, t - t0] = m
        _quant_row(row, m, mx, qf, (s * (T - t0) + t - t0) * C, hf, hb, a_n)
    return -1


@njit(nogil=True, cache=True)
def quantize_f32(x, t0, inv, mode, maxq, q, scales, hist, s0, s1):
    """x float32 [S,T,C] -> q uint8 [S,T-t0,C], scales float32 [S,T-t0], hist int32 [S,C,A]
    (tokens t0.. only: the first t0 are stored raw by the caller).  All C-contiguous.

    inv float32 [S,C] multiplies each channel first (all ones: LMCache's arithmetic,
    exactly); `mode` rounds scales up to their stored type (see `_round_scale`).
    Returns -1, the first stream holding inf/NaN, or -2 if a float16 scale overflows."""
    _, T, C = x.shape
    row = np.empty(C, np.float32)
    rowbits = row.view(np.int32)
    xf = x.reshape(-1)
    invf = inv.reshape(-1)
    for s in range(s0, s1):
        r = _quantize_rows(row, rowbits, s, t0, T, mode, maxq, q, scales, hist, xf, invf, 0)
        if r != -1:
            return r
    return -1


@njit(nogil=True, cache=True, inline="always")
def _f16_value(h):
    """The float32 value of float16 bits `h` (exact, inf/NaN kept so; vectorizable):
    exponent and mantissa moved into float32's fields and scaled by 2**112 (which also
    normalises subnormals), sign put back."""
    em = np.uint32(h & np.uint32(0x7FFF))
    sh = np.uint32(em << np.uint32(13))
    v = np.float32(sh.view(np.float32) * F16_TO_F32)
    b = np.uint32(sh | np.uint32(0x7F800000)) if em >= np.uint32(0x7C00) else v.view(np.uint32)
    return np.uint32(b | np.uint32((h & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


@njit(nogil=True, cache=True)
def quantize_u16(x, t0, bf16, inv, mode, maxq, q, scales, hist, s0, s1):
    """As `quantize_f32` for 16-bit floats given as raw bits: bfloat16 if `bf16`, else
    float16 (converted exactly, as torch converts them)."""
    _, T, C = x.shape
    row = np.empty(C, np.float32)
    rowbits = row.view(np.int32)
    xf = x.reshape(-1)
    invf = inv.reshape(-1)
    kind = 2 if bf16 else 1
    for s in range(s0, s1):
        r = _quantize_rows(row, rowbits, s, t0, T, mode, maxq, q, scales, hist, xf, invf, kind)
        if r != -1:
            return r
    return -1


@njit(nogil=True, cache=True, fastmath=True)
def choose_tables(hist, alpha, base, ksize, clt, tab, s0, s1):
    """Per channel, the table (global index base[s] + k, k < ksize[s]) that codes its
    histogram hist[s, c, :alpha[s]] in the fewest bits, the first such on ties; clt
    float32 [A, NT] code lengths.  (fastmath only reorders sums of code lengths: the
    choice is stored, never recomputed.)

    The choice is a minimum over 64-bit keys ``cost bits << 32 | k``: costs are sums of
    non-negative code lengths, so their float32 bits order as the costs do, and the
    smallest key is the first table of least cost.  A compare-and-select scan carried
    one dependency through all K (128-256) tables and took 70% of this kernel; a
    minimum of integers vectorizes."""
    _, C, _ = hist.shape
    nt = clt.shape[1]
    flat = clt.reshape(-1)
    cost = np.empty(nt, np.float32)
    bits = cost.view(np.int32)
    for s in range(s0, s1):
        b = base[s]
        K = ksize[s]
        a_n = alpha[s]
        for c in range(C):
            h = hist[s, c]
            for k in range(K):
                cost[_u(k)] = 0
            for a in range(a_n):
                w = np.float32(h[_u(a)])
                if w != 0:
                    row = a * nt + b  # clt[a, b:b+K]
                    for k in range(K):
                        cost[_u(k)] += w * flat[_u(row + k)]
            key = np.int64(0x7FFFFFFFFFFFFFFF)
            for k in range(K):
                key = min(key, (np.int64(bits[_u(k)]) << 32) | k)
            tab[s, c] = b + (key & 0xFFFFFFFF)


def encoder_tables(freq, cum):
    """Per (table, symbol) reciprocals so encoding needs no division (exact for x < 2**31):
    x // f == ((x * rcp) >> 32) >> shift, then x' = x + bias + q * (PROB_SCALE - f)."""
    f = freq.astype(np.uint64)
    shift = np.zeros(f.shape, np.int64)
    while True:
        more = f > (np.uint64(1) << shift.astype(np.uint64))
        if not more.any():
            break
        shift += more
    one = f == 1
    sh = np.maximum(shift, 1).astype(np.uint64)
    rcp = ((np.uint64(1) << (sh + np.uint64(31))) + f - np.uint64(1)) // np.maximum(f, np.uint64(1))
    rcp = np.where(one, np.uint64(0xFFFFFFFF), rcp).astype(np.int64)
    rshift = np.where(one, 0, shift - 1).astype(np.int64)
    bias = np.where(one, cum.astype(np.int64) + PROB_SCALE - 1, cum.astype(np.int64))
    cmpl = (PROB_SCALE - freq.astype(np.int64)).astype(np.int64)
    xmax = freq.astype(np.int64) << (31 - PROB_BITS)
    enc = np.stack([rcp, rshift, bias, cmpl, xmax], axis=-1)  # [NT, A, 5]
    return np.ascontiguousarray(enc)


@njit(nogil=True, cache=True, inline="always")
def _put(x, encf, o, buf, p):
    """Encode one symbol (the encoder entry at encf[o:o+5]) on state `x`, writing a
    renormalisation word below position `p` of `buf` when needed; returns (state,
    position).  Branch-free: the word is always stored at p-2, and p only moves down
    when it is kept (the bytes below p are not yet written, and p-2 >= STATE_BYTES-2 by
    the scratch size, so nothing is lost).  Renormalisation happens for about a quarter
    of the symbols in no predictable pattern, so a branch here mispredicts often."""
    r = np.int64(x >= encf[_u(o + 4)])
    buf[_u(p - 2)] = x & 0xFF
    buf[_u(p - 1)] = (x >> 8) & 0xFF
    p -= 2 * r
    x >>= 16 * r
    return x + encf[_u(o + 2)] + (((x * encf[_u(o)]) >> 32) >> encf[_u(o + 1)]) * encf[_u(o + 3)], p


@njit(nogil=True, cache=True)
def rans_encode(q, tab, enc, scratch, lengths, s0, s1):
    """Code streams [s0, s1): q uint8 [S,T,C], tab int32 [S,C] (global table per channel),
    enc int64 [NT, A, 5] from `encoder_tables`.  Stream s is written to the end of
    scratch[s] (uint8 rows of at least STATE_BYTES + 2*T*C bytes); lengths[s] gets its
    byte length."""
    _, T, C = q.shape
    a_n = enc.shape[1]
    encf = enc.reshape(-1)  # entry (table k, symbol a) at 5 * (k * a_n + a)
    qf = q.reshape(-1)
    cap = scratch.shape[1]
    for s in range(s0, s1):
        buf = scratch[s]
        p = cap
        # The four lane states in registers, as a window that turns one place a symbol:
        # w0 is the state of the lane of the symbol being coded (symbol i, lane i mod 4,
        # coded from the last symbol down), w1..w3 those of symbols i-1..i-3.  (States in
        # an array indexed by lane went through memory on every symbol: ~12% slower.)
        w0 = np.int64(RANS_L)
        w1 = np.int64(RANS_L)
        w2 = np.int64(RANS_L)
        w3 = np.int64(RANS_L)
        for c in range(C - 1, -1, -1):
            eb = np.int64(tab[s, c]) * a_n * 5
            qi = (s * T + T - 1) * C + c  # q[s, t, c], t from T-1 down
            for _ in range(T):
                o = eb + 5 * np.int64(qf[_u(qi)])
                qi -= C
                x, p = _put(w0, encf, o, buf, p)
                w0 = w1
                w1 = w2
                w2 = w3
                w3 = x
        # After symbol 0 the window holds the lanes of symbols -1..-4: lanes 3, 2, 1, 0.
        p -= STATE_BYTES
        for j, x in enumerate((w3, w2, w1, w0)):
            for b in range(4):
                buf[p + 4 * j + b] = (x >> (8 * b)) & 0xFF
        lengths[s] = cap - p


@njit(nogil=True, cache=True, inline="always")
def _f16_bits(f):
    """float32 -> float16 bits, rounded to nearest even, overflow to inf: the FP16
    library's `fp16_ieee_from_fp32_value` (what torch's float -> half conversion computes)
    in float32 arithmetic.  NaN gives 0x7E00 (decoded values are never NaN)."""
    base = (abs(f) * np.float32(5.192296858534828e33)) * np.float32(7.703719777548943e-34)
    w = np.int64(np.float32(f).view(np.uint32))
    shl1 = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1 & 0xFF000000, 0x71000000)
    base = np.float32(np.uint32((bias >> 1) + 0x07800000).view(np.float32) + base)
    bits = np.int64(np.float32(base).view(np.uint32))
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    return (sign >> 16) | (0x7E00 if shl1 > 0xFF000000 else nonsign)


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(f):
    """float32 -> bfloat16 bits, rounded to nearest even (torch's conversion; no NaN here)."""
    u = np.int64(np.float32(f).view(np.uint32))
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF


@njit(nogil=True, cache=True, inline="always")
def _state(data, p):
    """The little-endian u32 at data[p:p+4] as a coder state, or -1 if it cannot be one."""
    x = np.int64(0)
    for b in range(4):
        x |= np.int64(data[p + b]) << (8 * b)
    return x if RANS_L <= x < (1 << 31) else np.int64(-1)


@njit(nogil=True, cache=True, inline="always")
def _dsym(x, lutf, lb, fcf, fb):
    """One symbol off state `x` with the table at lutf[lb:], fcf[fb:]: (state before its
    refill, symbol)."""
    slot = x & (PROB_SCALE - 1)
    sym = np.int64(lutf[_u(lb + slot)])
    fc = np.int64(fcf[_u(fb + sym)])
    return (fc & 0xFFFF) * (x >> PROB_BITS) + slot - (fc >> 16), sym


@njit(nogil=True, cache=True, inline="always")
def _refill(x, data, pp):
    """The state after its refill from the word at data[pp:pp+2] (always read, taken only
    when `x` is below RANS_L: branch-free, see `_put`), and how far the read position moves."""
    r = np.int64(x < RANS_L)
    w = np.int64(data[_u(pp)]) | (np.int64(data[_u(pp + 1)]) << 8)
    return (x << (16 * r)) | (w & -r), 2 * r


@njit(nogil=True, cache=True, inline="always")
def _prefetch_next(lutf, nlb, fcf, nfb, a_n, t):
    """At symbol t (a multiple of 4) of a channel, one 64-byte line of the next channel's
    `lut` row (the whole row in T / 4 steps) and, every 32 symbols, one of its `fcum` row."""
    prefetch(lutf, _u(nlb + ((t << 4) & (PROB_SCALE - 1))))
    if (t & 31) == 0:
        prefetch(fcf, _u(nfb + min(t >> 1, a_n - 1)))


def decoder_table(freq, cum):
    """Per (table, symbol) the decoder's frequency and cumulative frequency in one word,
    freq | cum << 16, uint32 [NT, A]: one load per symbol instead of two."""
    return np.ascontiguousarray(freq.astype(np.uint32) | (cum.astype(np.uint32) << np.uint32(16)))


@njit(nogil=True, cache=True)
def rans_decode(data, offs, tab, fcum, lut, vals, vbase, scales, chs, out, t0, mode, s0, s1):
    """Decode and dequantize streams [s0, s1) into out[:, t0:] (out [S,T,C]; the first t0
    tokens were stored raw and are the caller's to write).

    data uint8 (all streams), offs int64 [S+1] byte offsets, tab int32 [S,C], fcum uint32
    [NT, A] from `decoder_table`, lut uint8 [NT, PROB_SCALE] slot->symbol, vals float32
    dequantization table with stream s's entries at vbase[s], scales float32 [S,T-t0], chs
    float32 [S,C] channel scales.  Values are computed in float32 and stored as they are
    (`mode` 0, out float32) or as the bits of float16 (1) or bfloat16 (2) in a uint16
    `out`, rounded as torch rounds, so the result is the float32 decode converted by torch,
    without the float32 copy.  Every read is bounds-checked; returns -1 on success, else
    the index of the first stream that is malformed.

    Tables: a codebook set holds hundreds of tables (4 KiB of `lut` each, megabytes in
    all) and a stream's channels each use their own, so the next channel's table would
    come from L3 or memory one symbol at a time; while a channel decodes, the next
    channel's `lut` and `fcum` rows are prefetched, a line every few symbols.
    """
    _, TT, C = out.shape
    T = TT - t0
    tmp = np.empty((T, C), np.float32)  # one stream (192 KiB at 256 x 192)
    tmpf = tmp.reshape(-1)
    lutf = lut.reshape(-1)
    fcf = fcum.reshape(-1)
    a_n = fcum.shape[1]
    for s in range(s0, s1):
        p = offs[s]
        end = offs[s + 1]
        if p < 0 or end > data.shape[0] or end - p < STATE_BYTES:
            return s
        # The lane states as a window that turns one place a symbol (see `rans_encode`):
        # w0 is the state of the lane of symbol i (decoded from symbol 0 up), w1..w3 those
        # of symbols i+1..i+3.
        w0 = _state(data, p)
        w1 = _state(data, p + 4)
        w2 = _state(data, p + 8)
        w3 = _state(data, p + 12)
        if min(w0, w1, w2, w3) < 0:
            return s
        p += STATE_BYTES
        vb = vbase[s]
        sc = scales[s]
        os_ = out[s]
        # Refills are branch-free (`_refill`): the next word is always read, at most at
        # end - 2 so reads stay inside the stream, and only consumed when the state is
        # below RANS_L.  A stream that runs past its end is caught once per channel (its
        # reads were clamped, its output is discarded with the error).  p >= 0 (checked
        # above) and only grows, so its reads index unsigned.
        last = end - 2
        for c in range(C):
            k = np.int64(tab[s, c])
            if c + 1 < C:
                kn = np.int64(tab[s, c + 1])
            elif s + 1 < s1:
                kn = np.int64(tab[s + 1, 0])
            else:
                kn = k
            lb = k << PROB_BITS
            fb = k * a_n
            nlb = kn << PROB_BITS
            nfb = kn * a_n
            cs = chs[s, c]
            ti = c  # tmp[t, c]
            t = 0
            if p + 2 * T <= end:
                # No read of this channel can pass the stream's end (a symbol moves p by 2
                # at most), so nothing is clamped; four symbols a step, each lane's state
                # updated in place (the window turns four places: back where it started).
                while t + 4 <= T:
                    _prefetch_next(lutf, nlb, fcf, nfb, a_n, t)
                    x, sym = _dsym(w0, lutf, lb, fcf, fb)
                    w0, d = _refill(x, data, p)
                    p += d
                    tmpf[_u(ti)] = vals[_u(vb + sym)] * sc[_u(t)] * cs
                    x, sym = _dsym(w1, lutf, lb, fcf, fb)
                    w1, d = _refill(x, data, p)
                    p += d
                    tmpf[_u(ti + C)] = vals[_u(vb + sym)] * sc[_u(t + 1)] * cs
                    x, sym = _dsym(w2, lutf, lb, fcf, fb)
                    w2, d = _refill(x, data, p)
                    p += d
                    tmpf[_u(ti + 2 * C)] = vals[_u(vb + sym)] * sc[_u(t + 2)] * cs
                    x, sym = _dsym(w3, lutf, lb, fcf, fb)
                    w3, d = _refill(x, data, p)
                    p += d
                    tmpf[_u(ti + 3 * C)] = vals[_u(vb + sym)] * sc[_u(t + 3)] * cs
                    ti += 4 * C
                    t += 4
            # The rest of the channel (or all of it near the stream's end, reads clamped
            # to end - 2), one symbol a step, the window turning one place a symbol.
            while t < T:
                if (t & 3) == 0:
                    _prefetch_next(lutf, nlb, fcf, nfb, a_n, t)
                x, sym = _dsym(w0, lutf, lb, fcf, fb)
                x, d = _refill(x, data, min(p, last))
                w0 = w1
                w1 = w2
                w2 = w3
                w3 = x
                p += d
                tmpf[_u(ti)] = vals[_u(vb + sym)] * sc[_u(t)] * cs
                ti += C
                t += 1
            if p > end:
                return s
        if p != end:
            return s
        if w0 != RANS_L or w1 != RANS_L or w2 != RANS_L or w3 != RANS_L:
            return s
        # The stream's values, in cache, to the output in one vectorizable pass.
        if mode == 0:
            for t in range(T):
                for c in range(C):
                    os_[t0 + t, c] = tmp[t, c]
        elif mode == 1:
            for t in range(T):
                for c in range(C):
                    os_[t0 + t, c] = _f16_bits(tmp[t, c])
        else:
            for t in range(T):
                for c in range(C):
                    os_[t0 + t, c] = _bf16_bits(tmp[t, c])
    return -1


@njit(nogil=True, cache=True, inline="always")
def _quantize_one_u16(x, t0, bf16, inv, mode, maxq, q, scales, hist):
    return quantize_u16(x, t0, bf16, inv, mode, maxq, q, scales, hist, 0, 1)


@njit(nogil=True, cache=True, inline="always")
def _quantize_one_f32(x, t0, bf16, inv, mode, maxq, q, scales, hist):
    return quantize_f32(x, t0, inv, mode, maxq, q, scales, hist, 0, 1)


# Streams one at a time, through buffers of one stream that stay in cache (the chunk's
# symbols are never all materialised), coded streams written one after another into
# out[start:].  Each step is the kernel above on that one stream, so the bytes are
# theirs.  Both return (-1, end), or (s, _) for a stream holding inf/NaN, or (-2, _)
# when a float16 scale overflows (see `quantize_f32`).  Two top-level functions, not one
# made by a factory: numba caches only module-level functions on disk.


@njit(nogil=True, cache=True)
def encode_u16(
    x, t0, bf16, inv, mode, maxq, scales, alpha, base, ksize, clt, enc, tab, lengths, out, start, s0, s1
):
    """Quantize, choose tables for and code streams [s0, s1) of 16-bit floats (x uint16 bits; bfloat16 if `bf16`, else float16)."""
    _, TT, C = x.shape
    T = TT - t0  # tokens coded (the first t0 are stored raw by the caller)
    cap = STATE_BYTES + 2 * T * C
    q = np.empty((1, T, C), np.uint8)
    hist = np.empty((1, C, clt.shape[0]), np.int32)
    scratch = np.empty((1, cap), np.uint8)
    o = start
    for s in range(s0, s1):
        r = _quantize_one_u16(
            x[s : s + 1], t0, bf16, inv[s : s + 1], mode, maxq[s : s + 1], q, scales[s : s + 1], hist
        )
        if r != -1:
            return (s if r >= 0 else r), o
        choose_tables(hist, alpha[s : s + 1], base[s : s + 1], ksize[s : s + 1], clt, tab[s : s + 1], 0, 1)
        rans_encode(q, tab[s : s + 1], enc, scratch, lengths[s : s + 1], 0, 1)
        n = lengths[s]
        out[o : o + n] = scratch[0, cap - n :]
        o += n
    return -1, o


@njit(nogil=True, cache=True)
def encode_f32(
    x, t0, bf16, inv, mode, maxq, scales, alpha, base, ksize, clt, enc, tab, lengths, out, start, s0, s1
):
    """As `encode_u16` for float32 input (`bf16` unused)."""
    _, TT, C = x.shape
    T = TT - t0  # tokens coded (the first t0 are stored raw by the caller)
    cap = STATE_BYTES + 2 * T * C
    q = np.empty((1, T, C), np.uint8)
    hist = np.empty((1, C, clt.shape[0]), np.int32)
    scratch = np.empty((1, cap), np.uint8)
    o = start
    for s in range(s0, s1):
        r = _quantize_one_f32(
            x[s : s + 1], t0, bf16, inv[s : s + 1], mode, maxq[s : s + 1], q, scales[s : s + 1], hist
        )
        if r != -1:
            return (s if r >= 0 else r), o
        choose_tables(hist, alpha[s : s + 1], base[s : s + 1], ksize[s : s + 1], clt, tab[s : s + 1], 0, 1)
        rans_encode(q, tab[s : s + 1], enc, scratch, lengths[s : s + 1], 0, 1)
        n = lengths[s]
        out[o : o + n] = scratch[0, cap - n :]
        o += n
    return -1, o
