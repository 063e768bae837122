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
"""

from __future__ import annotations

import numpy as np
from numba import njit

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 15
LANES = 4
STATE_BYTES = 4 * LANES


@njit(nogil=True, cache=True, inline="always")
def _quant_row(row, m, mx, qrow, hist_s):
    """Quantize one token's channels (float32 `row`, absmax `m`) and count the symbols."""
    n = row.shape[0]
    fmx = np.float32(mx)
    top = 2 * mx
    if m == np.float32(0.0):
        for c in range(n):
            qrow[c] = mx
    else:
        f = fmx / m
        if f == np.inf:
            # m is subnormal: MAX / m overflows float32; divide in float64 instead.
            dm = np.float64(m)
            for c in range(n):
                qi = int(np.rint(np.float64(row[c]) / dm * mx + mx))
                qrow[c] = min(max(qi, 0), top)
        else:
            for c in range(n):
                t = row[c] * f
                qi = np.int32(np.rint(t + fmx))
                qrow[c] = min(max(qi, 0), top)
    for c in range(n):
        hist_s[c, qrow[c]] += 1


@njit(nogil=True, cache=True, inline="always")
def _absmax(row, rowbits):
    """(max |row|, ok): magnitudes of finite floats order like their bits (vectorizable)."""
    mb = np.int32(0)
    for c in range(row.shape[0]):
        mb = max(mb, rowbits[c] & 0x7FFFFFFF)
    if mb >= 0x7F800000:
        return np.float32(0.0), False
    for c in range(row.shape[0]):
        if (rowbits[c] & 0x7FFFFFFF) == mb:
            return abs(row[c]), True
    return np.float32(0.0), True


@njit(nogil=True, cache=True, inline="always")
def _round_scale(m, mode, cell):
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
        low = 0x1FFF
    else:
        low = 0xFFFF
    cell[0] = m
    bits = cell.view(np.int32)
    if bits[0] & low:
        bits[0] = (bits[0] | low) + 1
    r = cell[0]
    if mode == 1 and r > np.float32(65504.0):
        return np.float32(np.inf)
    return r


@njit(nogil=True, cache=True)
def quantize_f32(x, inv, mode, maxq, q, scales, hist, s0, s1):
    """x float32 [S,T,C] -> q uint8 [S,T,C], scales float32 [S,T], hist int32 [S,C,A].

    inv float32 [S,C] multiplies each channel first (all ones: LMCache's arithmetic,
    exactly); `mode` rounds scales up to their stored type (see `_round_scale`).
    Returns -1, the first stream holding inf/NaN, or -2 if a float16 scale overflows."""
    _, T, C = x.shape
    row = np.empty(C, np.float32)
    rowbits = row.view(np.int32)
    cell = np.empty(1, np.float32)
    for s in range(s0, s1):
        mx = maxq[s]
        hist[s, :, :] = 0
        iv = inv[s]
        for t in range(T):
            xr = x[s, t]
            for c in range(C):
                row[c] = xr[c] * iv[c]
            m, ok = _absmax(row, rowbits)
            if not ok:
                return s
            m = _round_scale(m, mode, cell)
            if m == np.inf:
                return -2
            scales[s, t] = m
            _quant_row(row, m, mx, q[s, t], hist[s])
    return -1


@njit(nogil=True, cache=True)
def quantize_u16(x, lut, inv, mode, maxq, q, scales, hist, s0, s1):
    """As `quantize_f32` for 16-bit floats given as raw bits and a bits->float32 table."""
    _, T, C = x.shape
    row = np.empty(C, np.float32)
    rowbits = row.view(np.int32)
    cell = np.empty(1, np.float32)
    for s in range(s0, s1):
        mx = maxq[s]
        hist[s, :, :] = 0
        iv = inv[s]
        for t in range(T):
            xr = x[s, t]
            for c in range(C):
                row[c] = lut[xr[c]] * iv[c]
            m, ok = _absmax(row, rowbits)
            if not ok:
                return s
            m = _round_scale(m, mode, cell)
            if m == np.inf:
                return -2
            scales[s, t] = m
            _quant_row(row, m, mx, q[s, t], hist[s])
    return -1


@njit(nogil=True, cache=True, fastmath=True)
def choose_tables(hist, alpha, base, ksize, clt, tab, s0, s1):
    """Per channel, the table (global index base[s] + k, k < ksize[s]) that codes its
    histogram hist[s, c, :alpha[s]] in the fewest bits; clt float32 [A, NT] code lengths.
    (fastmath only reorders sums of code lengths: the choice is stored, never recomputed.)"""
    _, C, _ = hist.shape
    cost = np.empty(clt.shape[1], np.float32)
    for s in range(s0, s1):
        b = base[s]
        K = ksize[s]
        a_n = alpha[s]
        for c in range(C):
            h = hist[s, c]
            cst = cost[:K]
            cst[:] = 0
            for a in range(a_n):
                w = np.float32(h[a])
                if w != 0:
                    row = clt[a, b : b + K]
                    for k in range(K):
                        cst[k] += w * row[k]
            best = 0
            bc = cst[0]
            for k in range(1, K):
                if cst[k] < bc:
                    bc = cst[k]
                    best = k
            tab[s, c] = b + best


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


@njit(nogil=True, cache=True)
def rans_encode(q, tab, enc, scratch, lengths, s0, s1):
    """Code streams [s0, s1): q uint8 [S,T,C], tab int32 [S,C] (global table per channel),
    enc int64 [NT, A, 5] from `encoder_tables`.  Stream s is written to the end of
    scratch[s] (uint8 rows of at least STATE_BYTES + 2*T*C bytes); lengths[s] gets its
    byte length."""
    _, T, C = q.shape
    cap = scratch.shape[1]
    xs = np.empty(LANES, np.int64)
    for s in range(s0, s1):
        buf = scratch[s]
        p = cap
        for j in range(LANES):
            xs[j] = RANS_L
        i = T * C - 1
        for c in range(C - 1, -1, -1):
            e = enc[tab[s, c]]
            for t in range(T - 1, -1, -1):
                es = e[q[s, t, c]]
                lane = i & (LANES - 1)
                x = xs[lane]
                if x >= es[4]:
                    p -= 2
                    buf[p] = x & 0xFF
                    buf[p + 1] = (x >> 8) & 0xFF
                    x >>= 16
                qq = ((x * es[0]) >> 32) >> es[1]
                xs[lane] = x + es[2] + qq * es[3]
                i -= 1
        p -= STATE_BYTES
        for j in range(LANES):
            x = xs[j]
            for b in range(4):
                buf[p + 4 * j + b] = (x >> (8 * b)) & 0xFF
        lengths[s] = cap - p


@njit(nogil=True, cache=True)
def rans_decode(data, offs, tab, freq, cum, lut, vals, vbase, scales, chs, out, s0, s1):
    """Decode and dequantize streams [s0, s1) into out float32 [S,T,C].

    data uint8 (all streams), offs int64 [S+1] byte offsets, tab int32 [S,C], lut uint8
    [NT, PROB_SCALE] slot->symbol, vals float32 dequantization table with stream s's
    entries at vbase[s], scales float32 [S,T], chs float32 [S,C] channel scales.  Every read is bounds-checked; returns -1
    on success, else the index of the first stream that is malformed.
    """
    _, T, C = out.shape
    xs = np.empty(LANES, np.int64)
    mask = PROB_SCALE - 1
    for s in range(s0, s1):
        p = offs[s]
        end = offs[s + 1]
        if p < 0 or end > data.shape[0] or end - p < STATE_BYTES:
            return s
        for j in range(LANES):
            x = np.int64(0)
            for b in range(4):
                x |= np.int64(data[p + 4 * j + b]) << (8 * b)
            if x < RANS_L or x >= (1 << 31):
                return s
            xs[j] = x
        p += STATE_BYTES
        vb = vbase[s]
        i = 0
        for c in range(C):
            k = tab[s, c]
            fr = freq[k]
            cu = cum[k]
            lk = lut[k]
            cs = chs[s, c]
            for t in range(T):
                lane = i & (LANES - 1)
                x = xs[lane]
                slot = x & mask
                sym = lk[slot]
                x = np.int64(fr[sym]) * (x >> PROB_BITS) + slot - np.int64(cu[sym])
                if x < RANS_L:
                    if p + 2 > end:
                        return s
                    x = (x << 16) | np.int64(data[p]) | (np.int64(data[p + 1]) << 8)
                    p += 2
                xs[lane] = x
                out[s, t, c] = vals[vb + sym] * scales[s, t] * cs
                i += 1
        if p != end:
            return s
        for j in range(LANES):
            if xs[j] != RANS_L:
                return s
    return -1
