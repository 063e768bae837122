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
hand both to a gather write and never copy the payload.  With ``sealed=False`` it returns
an `UnsealedFrame`: the header's place is held (same length, magic zeroed, so bytes
written before the seal read back as "not a frame", never as a chunk), and the payload
checksum is filled in later, either by a writer that hashes each block as it writes
it (one pass over the payload instead of two: `kvstore.checksum.pwrite_crc32c`) or by
`UnsealedFrame.ensure_sealed` (a separate pass) before any other writer sees the bytes.
`decode_frame` returns a memoryview of the payload inside the caller's buffer: zero
copies.  Any defect raises a
subclass of `FrameError`; nothing is ever unpickled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
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
_UNSET_CSUM = 0xFFFFFFFF  # an unsealed frame's header holds this: the longest checksum's encoding


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
    sealed: bool = True,
) -> list[memoryview]:
    """Frame a payload given as parts; returns the parts to write, payload uncopied.

    ``sealed=False``: an `UnsealedFrame`, its checksum not computed yet (see there)."""
    views = [p if isinstance(p, memoryview) else memoryview(p) for p in payload_parts]
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
    header = FrameHeader(
        codec=codec,
        dtype=dtype,
        shape=tuple(int(d) for d in shape),
        layout=layout,
        plen=sum(v.nbytes for v in views),
        csum=checksum(views) if sealed else _UNSET_CSUM,
        key=key,
        ctime=time.time() if ctime is None else ctime,
        meta=meta or {},
    )
    hbytes = _packed_header(header)
    if not sealed:
        return UnsealedFrame(header, bytearray(PREFIX_LEN + len(hbytes)), views)
    prefix = PREFIX.pack(MAGIC, VERSION, 0, 0, len(hbytes), zlib.crc32(hbytes))
    return [memoryview(prefix + hbytes), *views]


class UnsealedFrame(list[memoryview]):
    """A frame whose payload checksum is still to be computed: a list of parts like any
    frame (``[prefix + header, *payload]``) whose first part holds zeros of the header's
    final length until `seal` writes the header in place.

    Exactly one party computes the checksum.  A writer that hashes the payload as it
    writes it first takes the frame with `claim` (False: another party has it; call
    `ensure_sealed`), then calls `seal` with the checksum of what it wrote, or `release`
    if it failed.  Anyone else about to read the header calls `ensure_sealed` (blocking:
    it waits for a claimant, or computes the checksum itself), on a worker thread.
    """

    def __init__(self, header: FrameHeader, head: bytearray, payload: list[memoryview]) -> None:
        super().__init__([memoryview(head), *payload])
        self.header = header
        self._head = head
        self._state = "open"  # "claimed" while one party computes the checksum, then "sealed"
        self._cond = threading.Condition()

    @property
    def payload(self) -> list[memoryview]:
        return self[1:]

    @property
    def head_len(self) -> int:
        """Bytes of prefix and header: where the payload starts in the object."""
        return len(self._head)

    @property
    def sealed(self) -> bool:
        return self._state == "sealed"

    def claim(self) -> bool:
        """Take the checksum on: True once for the first caller while unsealed."""
        with self._cond:
            if self._state != "open":
                return False
            self._state = "claimed"
            return True

    def release(self) -> None:
        """Give a claim back unsealed (the claimant's write failed)."""
        with self._cond:
            if self._state == "claimed":
                self._state = "open"
                self._cond.notify_all()

    def seal(self, csum: int) -> memoryview:
        """Write the header for payload checksum `csum` in place (by the claimant);
        returns it (the first part)."""
        header = dataclasses.replace(self.header, csum=csum)
        hlen = len(self._head) - PREFIX_LEN
        m = header.to_map()
        m["pad"] = b""
        short = hlen - len(msgpack.packb(m, use_bin_type=True))
        m["pad"] = bytes(short)  # a checksum packs in at most the placeholder's bytes
        hbytes = msgpack.packb(m, use_bin_type=True)
        assert len(hbytes) == hlen, (len(hbytes), hlen)
        with self._cond:
            if self._state != "claimed":
                raise RuntimeError(f"UnsealedFrame.seal by a party without the claim (state {self._state})")
            self._head[PREFIX_LEN:] = hbytes
            self._head[:PREFIX_LEN] = PREFIX.pack(MAGIC, VERSION, 0, 0, hlen, zlib.crc32(hbytes))
            self.header = header
            self._state = "sealed"
            self._cond.notify_all()
        return self[0]

    def ensure_sealed(self) -> None:
        """Return once the header is written: wait for a claimant, or claim and compute
        the checksum here (a pass over the payload; releases the GIL: call it off the loop)."""
        with self._cond:
            while self._state == "claimed":
                self._cond.wait()
            if self._state == "sealed":
                return
            self._state = "claimed"
        try:
            self.seal(checksum(self.payload))
        except BaseException:
            self.release()
            raise


async def seal_frames(frames: Iterable[Sequence[memoryview] | None]) -> None:
    """Seal those of `frames` that are `UnsealedFrame`s not sealed yet, on worker threads,
    all at once (each a checksum pass that releases the GIL)."""
    unsealed = [f for f in frames if isinstance(f, UnsealedFrame) and not f.sealed]
    if unsealed:
        await asyncio.gather(*(asyncio.to_thread(f.ensure_sealed) for f in unsealed))


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

