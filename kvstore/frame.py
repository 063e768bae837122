"""Self-describing, self-checking frames: the only format any backend stores.

Owns: the byte layout of a stored object and its validation.  Must not touch: I/O,
tensors (codecs turn tensors into payloads), backends.

Layout (little endian)::

    offset 0   4s   magic  b"KVSF"
           4   B    format version (1)
           5   B    flags (0; reserved)
           6   H    reserved (0)
           8   I    header length N
          12   I    crc32 of the header bytes
          16   N    msgpack header (a map; see `FrameHeader`)
          16+N      payload (header["plen"] bytes, checksum header["csum"])

Writers pad the header (a ``pad`` entry of zero bytes in the map, ignored by readers) so
the payload starts at a multiple of `PAYLOAD_ALIGN` bytes in the object.  The bytes are
copied between the page cache (or a buffer) and a caller's tensor, which allocators
align to 64 bytes or more; on this project's machines a copy whose source and
destination disagree modulo 64 ran ~15% slower in wall time and ~20% more CPU per read
(docs/benchmarks/lmcache.md, "Aligned payloads").  Frames without the padding, as
written before it, read the same way.

The payload checksum is CRC32C (`kvstore.checksum`: carry-less-multiply folding at
~45 GiB/s where the CPU has VPCLMULQDQ (AVX-512 or AVX2), else the ``crc32c`` package's SSE4.2
code at ~24 GiB/s; both release the GIL, so a large frame is verified on the other core
while I/O goes on).  The header carries its own
crc32, so a flipped bit in the header is caught before any of its fields is trusted.

`encode_frame` returns the prefix+header separately from the payload, so a writer can
hand both to a gather write and never copy the payload.  `decode_frame` returns a
memoryview of the payload inside the caller's buffer: zero copies.  Any defect raises a
subclass of `FrameError`; nothing is ever unpickled.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvstore.checksum import crc32c

MAGIC = b"KVSF"
VERSION = 1
PREFIX = struct.Struct("<4sBBHII")
PREFIX_LEN = PREFIX.size
MAX_HEADER_LEN = 1 << 20
PAYLOAD_ALIGN = 64  # the payload's offset in a frame written by `encode_frame` is a multiple of this
PAD_MAX = PAYLOAD_ALIGN + 5  # the most bytes the padding adds to a header (key, bin8 marker, zeros)
CHECKSUM_ALGO = "crc32c"


class FrameError(Exception):
    """A stored object that is not a valid frame; readers turn it into a miss."""


class BadMagicError(FrameError):
    """The object does not start with the frame magic (not a kvstore object)."""


class UnsupportedVersionError(FrameError):
    """Written by a newer kvstore; upgrade to read it."""


class CorruptHeaderError(FrameError):
    """The header fails its crc32 or cannot be parsed."""


class LengthMismatchError(FrameError):
    """The object is shorter or longer than its header says (truncated or appended)."""


class ChecksumMismatchError(FrameError):
    """The payload does not match its checksum (bit rot or a torn write)."""


class MisplacedFrameError(FrameError):
    """An intact frame stored under another object's name (files swapped or copied)."""


def check_key(header: FrameHeader, name: str) -> None:
    """Raise `MisplacedFrameError` unless `header` was written for object `name`.

    A frame without a key (or with another one) is not `name`'s: serving it would hand
    one key's tensor to another, so every reader that knows the name it asked for checks.
    """
    if header.key != name:
        raise MisplacedFrameError(f"frame belongs to {header.key!r}, not {name!r}")


def checksum(parts: Sequence[memoryview | bytes | bytearray]) -> int:
    """CRC32C over the concatenation of `parts`, without concatenating them.

    Releases the GIL on large buffers, so callers may run it in a worker thread.
    """
    value = 0
    for p in parts:
        value = crc32c(p, value)
    return value


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame says about its payload.  `meta` is free-form, msgpack-able."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    plen: int
    csum: int
    key: str = ""
    ctime: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_map(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "layout": self.layout,
            "plen": self.plen,
            "csum": self.csum,
            "calg": CHECKSUM_ALGO,
            "key": self.key,
            "ctime": self.ctime,
            "meta": self.meta,
        }

    @classmethod
    def from_map(cls, m: Any) -> FrameHeader:
        if not isinstance(m, dict):
            raise CorruptHeaderError("frame header is not a map")
        try:
            if m.get("calg", CHECKSUM_ALGO) != CHECKSUM_ALGO:
                raise CorruptHeaderError(f"unknown checksum algorithm {m.get('calg')!r}")
            return cls(
                codec=str(m["codec"]),
                dtype=str(m["dtype"]),
                shape=tuple(int(d) for d in m["shape"]),
                layout=str(m["layout"]),
                plen=int(m["plen"]),
                csum=int(m["csum"]),
                key=str(m.get("key", "")),
                ctime=float(m.get("ctime", 0.0)),
                meta=dict(m.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptHeaderError(f"frame header field missing or mistyped: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Frame:
    header: FrameHeader
    payload: memoryview


def encode_frame(
    payload_parts: Sequence[memoryview | bytes | bytearray],
    *,
    codec: str,
    dtype: str = "uint8",
    shape: Sequence[int] = (),
    layout: str = "bytes",
    key: str = "",
    meta: dict[str, Any] | None = None,
    ctime: float | None = None,
) -> list[memoryview]:
    """Frame a payload given as parts; returns the parts to write, payload uncopied."""
    views = [p if isinstance(p, memoryview) else memoryview(p) for p in payload_parts]
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
    header = FrameHeader(
        codec=codec,
        dtype=dtype,
        shape=tuple(int(d) for d in shape),
        layout=layout,
        plen=sum(v.nbytes for v in views),
        csum=checksum(views),
        key=key,
        ctime=time.time() if ctime is None else ctime,
        meta=meta or {},
    )
    hbytes = _packed_header(header)
    prefix = PREFIX.pack(MAGIC, VERSION, 0, 0, len(hbytes), zlib.crc32(hbytes))
    return [memoryview(prefix + hbytes), *views]


def _packed_header(header: FrameHeader) -> bytes:
    """The msgpack header, padded so that the payload after it starts at a multiple of
    `PAYLOAD_ALIGN` in the frame (see the module docstring)."""
    m = header.to_map()
    m["pad"] = b""  # packed as bin8: up to 255 more bytes add exactly their own length
    hbytes = msgpack.packb(m, use_bin_type=True)
    short = -(PREFIX_LEN + len(hbytes)) % PAYLOAD_ALIGN
    if short and len(hbytes) + short <= MAX_HEADER_LEN:  # a header at the limit stays unpadded
        m["pad"] = bytes(short)
        hbytes = msgpack.packb(m, use_bin_type=True)
        assert (PREFIX_LEN + len(hbytes)) % PAYLOAD_ALIGN == 0
    return hbytes


def read_header(buf: memoryview | bytes | bytearray, *, key: str | None = None) -> tuple[FrameHeader, int]:
    """Parse and check the prefix and header; return them and the payload offset.

    With `key` (the name the object was read under), a frame written for another name
    raises `MisplacedFrameError`.
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    if len(mv) < PREFIX_LEN:
        raise LengthMismatchError(f"object of {len(mv)} bytes is shorter than a frame prefix")
    magic, version, _flags, _res, hlen, hcrc = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadMagicError(f"bad magic {bytes(magic)!r}; not a kvstore frame")
    if version != VERSION:
        raise UnsupportedVersionError(
            f"frame version {version}; this kvstore reads version {VERSION} — upgrade kvstore"
        )
    if hlen > MAX_HEADER_LEN or PREFIX_LEN + hlen > len(mv):
        raise LengthMismatchError(f"header length {hlen} does not fit in {len(mv)} bytes")
    hbytes = mv[PREFIX_LEN : PREFIX_LEN + hlen]
    if zlib.crc32(hbytes) != hcrc:
        raise CorruptHeaderError("frame header fails its crc32")
    try:
        m = msgpack.unpackb(hbytes, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptHeaderError(f"frame header is not valid msgpack: {exc}") from exc
    header = FrameHeader.from_map(m)
    if key is not None:
        check_key(header, key)
    return header, PREFIX_LEN + hlen


def decode_frame(
    buf: memoryview | bytes | bytearray, *, verify: bool = True, key: str | None = None
) -> Frame:
    """Check a whole stored object; return its header and a zero-copy payload view.

    With `key`, the frame must have been written for that object name (see `check_key`).
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    header, off = read_header(mv, key=key)
    if len(mv) - off != header.plen:
        raise LengthMismatchError(
            f"payload is {len(mv) - off} bytes, header says {header.plen} (truncated or torn)"
        )
    payload = mv[off:]
    if verify and checksum([payload]) != header.csum:
        raise ChecksumMismatchError("payload fails its checksum")
    return Frame(header, payload)
