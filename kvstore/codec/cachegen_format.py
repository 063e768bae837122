"""The `cachegen` payload's flat binary layout (inside a kvstore frame).  No pickle.

Owns: packing and bounds-checked parsing of the payload sections.  Must not touch:
quantization or entropy coding (it only slices bytes).

Layout, little endian::

    0   4s  magic b"KVCG"
    4   H   format version (1)
    6   B   planes P (2: K and V, layout KV_2LTD; 1: MLA)
    7   B   value dtype code        8  B  scale dtype code
    9   B   probability bits       10  B  rANS lanes           11  B  flags
            (bit 0: channel scales; bit 1: raw leading tokens)
    12  I   layers L   16  I  tokens T   20  I  channels C
    24  Q   codebook digest        32  H  codebook id length n, then n bytes of UTF-8
    with flag bit 1:  H  raw leading tokens R (1 <= R <= T); else R = 0
    then, in order:  bins           u8  [P, L]
                     table choice   u8  [P, L, C]
                     stream bytes   u32 [P, L]
                     scales         scale dtype [P, L, T-R]
                     raw tokens     value dtype [P, L, R, C] (the first R tokens, verbatim)
                     streams        (each: 4 x u32 rANS states, then 16-bit words; T-R tokens)

A payload without raw tokens (flag bit 1 clear) is laid out exactly as before the flag
existed, so older payloads parse unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvstore.frame import FrameError

MAGIC = b"KVCG"
VERSION = 1
HEAD = struct.Struct("<4sHBBBBBBIIIQH")
DTYPES = ("float16", "bfloat16", "float32")
MAX_DIM = 1 << 24
RAW = struct.Struct("<H")
FLAG_CHANNEL_SCALES = 1
FLAG_RAW_TOKENS = 2


class CacheGenPayloadError(FrameError):
    """A cachegen payload that is truncated, malformed or from an unknown version."""


@dataclass(frozen=True)
class Layout:
    planes: int
    layers: int
    tokens: int
    channels: int
    dtype: str
    scale_dtype: str
    prob_bits: int
    lanes: int
    codebook_id: str
    codebook_digest: int
    channel_scaled: bool = False
    raw_tokens: int = 0  # leading tokens stored verbatim (not quantized)

    @property
    def streams(self) -> int:
        return self.planes * self.layers

    @property
    def coded_tokens(self) -> int:
        return self.tokens - self.raw_tokens


@dataclass(frozen=True)
class Sections:
    layout: Layout
    bins: np.ndarray  # uint8 [P, L]
    tables: np.ndarray  # uint8 [P, L, C]
    stream_bytes: np.ndarray  # int64 [P*L]
    scales: bytes  # raw scale bytes [P, L, T-R]
    raw: bytes  # the first R tokens in the value dtype [P, L, R, C] (empty when R = 0)
    streams: memoryview  # all streams, concatenated
    streams_offset: int


def itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def pack_head(lay: Layout) -> bytes:
    cid = lay.codebook_id.encode()
    return (
        HEAD.pack(
            MAGIC,
            VERSION,
            lay.planes,
            DTYPES.index(lay.dtype),
            DTYPES.index(lay.scale_dtype),
            lay.prob_bits,
            lay.lanes,
            (FLAG_CHANNEL_SCALES if lay.channel_scaled else 0) | (FLAG_RAW_TOKENS if lay.raw_tokens else 0),
            lay.layers,
            lay.tokens,
            lay.channels,
            lay.codebook_digest,
            len(cid),
        )
        + cid
        + (RAW.pack(lay.raw_tokens) if lay.raw_tokens else b"")
    )


def parse(payload: memoryview) -> Sections:
    """Split a payload into checked sections; raises `CacheGenPayloadError`."""
    n = len(payload)
    if n < HEAD.size:
        raise CacheGenPayloadError(f"cachegen payload of {n} bytes is shorter than its header")
    magic, ver, planes, dcode, scode, pbits, lanes, flags, layers, tokens, chans, digest, idlen = (
        HEAD.unpack_from(payload, 0)
    )
    if magic != MAGIC:
        raise CacheGenPayloadError("payload is not cachegen (bad magic)")
    if ver != VERSION:
        raise CacheGenPayloadError(
            f"cachegen payload version {ver}; this kvstore reads {VERSION} — upgrade kvstore"
        )
    if planes not in (1, 2) or dcode >= len(DTYPES) or scode >= len(DTYPES) or flags > 3:
        raise CacheGenPayloadError("cachegen header fields out of range")
    if not (0 < layers < MAX_DIM and 0 < tokens < MAX_DIM and 0 < chans < MAX_DIM):
        raise CacheGenPayloadError(f"cachegen dimensions {layers}x{tokens}x{chans} out of range")
    off = HEAD.size
    if off + idlen > n:
        raise CacheGenPayloadError("cachegen payload truncated in its codebook id")
    try:
        cid = bytes(payload[off : off + idlen]).decode()
    except UnicodeDecodeError as exc:
        raise CacheGenPayloadError("cachegen codebook id is not UTF-8") from exc
    off += idlen
    raw_tokens = 0
    if flags & FLAG_RAW_TOKENS:
        if off + RAW.size > n:
            raise CacheGenPayloadError("cachegen payload truncated in its raw token count")
        (raw_tokens,) = RAW.unpack_from(payload, off)
        off += RAW.size
        if not 1 <= raw_tokens <= tokens:
            raise CacheGenPayloadError(f"cachegen payload says {raw_tokens} raw tokens of {tokens}")
    lay = Layout(
        planes,
        layers,
        tokens,
        chans,
        DTYPES[dcode],
        DTYPES[scode],
        pbits,
        lanes,
        cid,
        digest,
        bool(flags & FLAG_CHANNEL_SCALES),
        raw_tokens,
    )
    s = lay.streams
    nraw = s * raw_tokens * chans * itemsize(lay.dtype)
    need = s + s * chans + 4 * s + s * lay.coded_tokens * itemsize(lay.scale_dtype) + nraw
    if off + need > n:
        raise CacheGenPayloadError(f"cachegen payload truncated: {n} bytes, sections need {off + need}+")
    buf = np.frombuffer(payload, dtype=np.uint8)
    bins = buf[off : off + s].reshape(planes, layers)
    off += s
    tables = buf[off : off + s * chans].reshape(planes, layers, chans)
    off += s * chans
    sb = np.frombuffer(bytes(payload[off : off + 4 * s]), dtype="<u4").astype(np.int64)
    off += 4 * s
    nsc = s * lay.coded_tokens * itemsize(lay.scale_dtype)
    scales = bytes(payload[off : off + nsc])
    off += nsc
    raw = bytes(payload[off : off + nraw])
    off += nraw
    if off + int(sb.sum()) != n:
        raise CacheGenPayloadError(
            f"cachegen streams take {int(sb.sum())} bytes but {n - off} remain (truncated or padded)"
        )
    return Sections(lay, bins, tables, sb, scales, raw, payload[off:], off)
