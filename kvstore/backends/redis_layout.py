"""How kvstore objects are laid out in Redis keys: pure logic, no I/O.

Owns: the key names of one object, the multi-part manifest (encode / self-check /
decode), how a value is cut into parts, SCAN glob escaping, and TTL lookup per
namespace.  Must not touch: connections, redis-py, counters.

Layout of object ``NAME`` under key prefix ``P`` (default ``kv:``):

* ``P{NAME}``        the object itself when it fits in one part (raw bytes, no header,
                     so a GET moves exactly the caller's bytes), or else a manifest.
* ``P{NAME}:parts``  a hash holding the parts of a multi-part object, field
                     ``<generation hex>:<index>``.
* ``P{NAME}:tmp:<hex>``  a big value while it is sent hashed as it goes, before its
                     header is written and it is renamed to ``P{NAME}`` (it expires
                     by itself if the writer dies first).

The ``{NAME}`` hash tag puts both keys in one Cluster slot.  A manifest is
`MANIFEST_LEN` bytes: magic, part count, part size, total length, an 8-byte random
generation and an XXH3-64 checksum of the rest; a raw value is only taken for a
manifest if all of that matches.  Parts are written first, the manifest last (one SET,
atomic), so a reader sees either the old object or the new one; a part that is missing,
of the wrong length or of another generation makes the object a miss.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_PREFIX = "kv:"
PARTS_SUFFIX = ":parts"
MANIFEST_MAGIC = b"KVSRMAN1"
_MANIFEST = struct.Struct("<8sIQQ8s")  # magic, count, part_size, total, generation
MANIFEST_LEN = _MANIFEST.size + 8  # + checksum
REDIS_BULK_LIMIT = 512 * 1024 * 1024  # proto-max-bulk-len default


def check_prefix(prefix: str) -> str:
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"key prefix {prefix!r} must not contain '{{' or '}}' (they are Cluster hash tags)")
    return prefix


def data_key(prefix: str, name: str) -> str:
    return f"{prefix}{{{name}}}"


def parts_key(prefix: str, name: str) -> str:
    return f"{prefix}{{{name}}}{PARTS_SUFFIX}"


def temp_key(prefix: str, name: str, token: str) -> str:
    """Where a big value of `name` lands before it is complete (`token`: unique)."""
    return f"{prefix}{{{name}}}:tmp:{token}"


def part_field(generation: bytes, index: int) -> str:
    return f"{generation.hex()}:{index}"


def name_of_key(prefix: str, key: str) -> str | None:
    """The object name whose data key is `key`, or None for parts hashes / foreign keys."""
    if key.startswith(prefix + "{") and key.endswith("}"):
        return key[len(prefix) + 1 : -1]
    return None


def glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so `text` matches only itself in SCAN MATCH."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_pattern(prefix: str, name_prefix: str) -> str:
    """SCAN MATCH pattern for the data keys of objects whose name starts with `name_prefix`."""
    return glob_escape(prefix + "{" + name_prefix) + "*"


@dataclass(frozen=True, slots=True)
class Manifest:
    """Where the parts of one multi-part object are, and how to check them."""

    count: int
    part_size: int
    total: int
    generation: bytes

    def part_len(self, index: int) -> int:
        return min(self.part_size, self.total - index * self.part_size)

    def fields(self) -> list[str]:
        return [part_field(self.generation, i) for i in range(self.count)]

    def encode(self) -> bytes:
        body = _MANIFEST.pack(MANIFEST_MAGIC, self.count, self.part_size, self.total, self.generation)
        return body + xxhash.xxh3_64_digest(body)

    @classmethod
    def new(cls, total: int, part_size: int, now: float | None = None) -> Manifest:
        count = max(1, -(-total // part_size))
        return cls(count, part_size, total, new_generation(now))


def new_generation(now: float | None = None) -> bytes:
    """8 bytes naming one write of a multi-part object: the writer's clock in whole seconds
    (big-endian uint32), then 4 random bytes. The time lets garbage collection tell a
    write still under way (its parts are young) from parts no write will publish."""
    stamp = int(time.time() if now is None else now) & 0xFFFFFFFF
    return struct.pack(">I", stamp) + os.urandom(4)


def generation_age(field: bytes | str, now: float) -> float | None:
    """Seconds since the write that wrote parts field `field` (``<generation hex>:<i>``)
    began, or None when it cannot be told: a field of another form, or a generation
    written before generations carried the time (random bytes, which read as a time
    more than a day ahead or long before the store could have existed)."""
    text = field.decode("ascii", "replace") if isinstance(field, bytes) else field
    gen = text.split(":", 1)[0]
    if len(gen) != 16:
        return None
    try:
        stamp = int(gen[:8], 16)
    except ValueError:
        return None
    age = now - stamp
    if age < -86400 or stamp < 1_700_000_000:
        return None
    return age


def generation_hex(field: bytes | str) -> str:
    text = field.decode("ascii", "replace") if isinstance(field, bytes) else field
    return text.split(":", 1)[0]


def decode_manifest(data: bytes | memoryview | None) -> Manifest | None:
    """The manifest stored in `data`, or None when `data` is a plain value (or damaged)."""
    if data is None or len(data) != MANIFEST_LEN or bytes(data[:8]) != MANIFEST_MAGIC:
        return None
    body, check = bytes(data[: _MANIFEST.size]), bytes(data[_MANIFEST.size :])
    if xxhash.xxh3_64_digest(body) != check:
        return None
    _, count, part_size, total, gen = _MANIFEST.unpack(body)
    if part_size <= 0 or count != max(1, -(-total // part_size)):
        return None
    return Manifest(count, part_size, total, gen)


def split_parts(views: Sequence[memoryview], part_size: int) -> list[list[memoryview]]:
    """Cut a gathered value into consecutive pieces of `part_size` bytes (last one shorter).

    Each piece is a list of zero-copy slices: one slice when it lies inside one input
    view, several when it straddles views (e.g. a frame header and its payload).
    """
    out: list[list[memoryview]] = []
    pending: list[memoryview] = []
    pending_len = 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            take = min(part_size - pending_len, view.nbytes - pos)
            pending.append(view[pos : pos + take])
            pending_len += take
            pos += take
            if pending_len == part_size:
                out.append(pending)
                pending, pending_len = [], 0
    if pending or not out:
        out.append(pending)
    return out


def namespace_of(name: str) -> str:
    return name.split("/", 1)[0]


def ttl_ms_for(name: str, ttls: Mapping[str, float], default: float | None) -> int | None:
    """Milliseconds to live for object `name` (by its namespace), or None for no expiry."""
    ttl = ttls.get(namespace_of(name), default)
    if ttl is None or ttl <= 0:
        return None
    return max(1, int(ttl * 1000))
