"""Chunk keys and the object names they map to.

Owns: the `ChunkKey` value (namespace, model, world size, worker id, format, chunk
hash), its reversible mapping to a backend object name, and the escaping that keeps
names from outside safe.  Must not touch: I/O, frames, tensors.

An object name looks like ``<namespace>/<model>/<fmt>-<world_size>-<worker_id>/<hash>``.
Every component is escaped so that

* no name contains ``..``, a NUL, a leading ``/`` or an empty segment;
* ``<namespace>/`` and ``<namespace>/<model>/`` are exact listing prefixes: one tenant's
  prefix can never be a prefix of another's (``/`` inside a component is escaped);
* long components are shortened with a digest, so a name stays well under file-system
  limits (see `MAX_NAME_LEN`; the disk tier digests longer file names).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"
MAX_COMPONENT_LEN = 64
MAX_NAME_LEN = 320

_SAFE = re.compile(r"[A-Za-z0-9_\-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_\-]+")
_HEX_HASH = re.compile(r"^-?[0-9a-f]+$|^h(?:[0-9a-f]{2})*$")


class InvalidKeyError(ValueError):
    """A key or object name that cannot be stored; the message says which part is wrong."""


@functools.lru_cache(maxsize=4096)  # models, formats and namespaces repeat on every chunk
def escape_component(text: str) -> str:
    """Escape one name component: a reversible, path-safe spelling of `text`.

    Characters outside ``[A-Za-z0-9_-]`` become ``%XX`` (UTF-8 bytes, so ``.``, ``/``
    and NUL never survive); the empty string becomes ``%``.  Components longer than
    `MAX_COMPONENT_LEN` keep a readable head plus ``~`` and a 20-hex-digit digest; those
    are not reversible, which `unescape_component` reports.
    """
    if text == "":
        return "%"
    if len(text) <= MAX_COMPONENT_LEN and _ALL_SAFE.fullmatch(text):
        return text
    out = "".join(
        ch if _SAFE.fullmatch(ch) else "".join(f"%{b:02X}" for b in ch.encode("utf-8")) for ch in text
    )
    if len(out) > MAX_COMPONENT_LEN:
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=10).hexdigest()
        head = out[: MAX_COMPONENT_LEN - len(digest) - 1]
        head = head[: head.rfind("%")] if "%" in head[-2:] else head  # never split %XX
        out = f"{head}~{digest}"
    return out


def unescape_component(text: str) -> str:
    """Invert `escape_component`; raises `InvalidKeyError` for shortened components."""
    if text == "%":
        return ""
    if "~" in text:
        raise InvalidKeyError(f"component {text!r} was shortened with a digest; it cannot be read back")
    raw = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "%":
            try:
                raw.append(int(text[i + 1 : i + 3], 16))
            except ValueError as exc:
                raise InvalidKeyError(f"bad escape in component {text!r}") from exc
            i += 3
        else:
            raw += text[i].encode("ascii")
            i += 1
    return raw.decode("utf-8")


def printable_name(name: str) -> str:
    """`name` fit for a terminal line: control characters, newlines, backslashes, lone
    surrogates and other non-printables are written as Python escapes (``\\n``,
    ``\\x1b``, ``\\udc80``), so one name is always one unambiguous line."""
    out = []
    for ch in name:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable() and not 0xD800 <= ord(ch) <= 0xDFFF:
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
    return "".join(out)


def check_object_name(name: str) -> str:
    """Validate a backend object name; return it, or raise `InvalidKeyError` saying why.

    Backends call this before any I/O, so a hostile name is a counted error, never a
    path outside the backend's root.
    """
    if not isinstance(name, str) or not name:
        raise InvalidKeyError("object name must be a non-empty string")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: no backend can store it
        raise InvalidKeyError(
            f"object name {printable_name(name)} is not valid Unicode ({exc.reason})"
        ) from None
    if len(encoded) > MAX_NAME_LEN:
        raise InvalidKeyError(f"object name longer than {MAX_NAME_LEN} bytes; build names with ChunkKey")
    if "\x00" in name or "\\" in name:
        raise InvalidKeyError("object name contains NUL or backslash")
    if name.startswith("/"):
        raise InvalidKeyError("object name must be relative (no leading '/')")
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidKeyError(f"object name {name!r} has an empty, '.' or '..' segment")
    return name


def is_object_name(name: str) -> bool:
    """`check_object_name` as a yes or no."""
    try:
        check_object_name(name)
    except InvalidKeyError:
        return False
    return True


def _hash_text(chunk_hash: int | str | bytes) -> str:
    if isinstance(chunk_hash, bool):
        raise InvalidKeyError("chunk hash must be int, str or bytes, not bool")
    if isinstance(chunk_hash, int):
        return format(chunk_hash, "x")  # negative hashes keep their sign: "-1f"
    if isinstance(chunk_hash, bytes):
        return "h" + chunk_hash.hex()
    return "s" + escape_component(chunk_hash)


def _parse_hash(text: str) -> int | str | bytes:
    if text.startswith("s"):
        return unescape_component(text[1:])
    if text.startswith("h") and _HEX_HASH.match(text):
        return bytes.fromhex(text[1:])
    if _HEX_HASH.match(text):
        return int(text, 16)
    raise InvalidKeyError(f"bad chunk hash segment {text!r}")


@functools.lru_cache(maxsize=1024, typed=True)  # typed: 1 and 1.0 are spelled apart
def _group_prefix(namespace: str, model: str, fmt: str, world_size: int, worker_id: int) -> str:
    """``ns/model/fmt-W-R/``: the part of a chunk's name every chunk of one model, rank
    and format shares, escaped and checked once, not once per chunk."""
    if world_size < 1 or not 0 <= worker_id < max(world_size, 1):
        raise InvalidKeyError(f"worker_id {worker_id} outside world_size {world_size}")
    prefix = f"{escape_component(namespace)}/{escape_component(model)}/{escape_component(fmt)}-{world_size}-{worker_id}/"
    check_object_name(prefix + "0")
    return prefix


def chunk_object_name(
    namespace: str, model: str, fmt: str, world_size: int, worker_id: int, chunk_hash: int | str | bytes
) -> str:
    """`ChunkKey.object_name` without building the key (see `chunk_object_names`)."""
    return chunk_object_names(namespace, model, fmt, world_size, worker_id, (chunk_hash,))[0]


def chunk_object_names(
    namespace: str, model: str, fmt: str, world_size: int, worker_id: int, chunk_hashes: Iterable[int | str | bytes]
) -> list[str]:
    """`ChunkKey.object_name` of each hash in one group (a prompt's chunks) without
    building the keys: the group's part of the name is escaped and checked once
    (`_group_prefix`); the hash segment is ASCII, non-empty and never ``.`` or ``..``,
    so only the length is left to check."""
    prefix = _group_prefix(namespace, model, fmt, world_size, worker_id)
    names = [prefix + (format(h, "x") if type(h) is int else _hash_text(h)) for h in chunk_hashes]
    for name in names:
        if len(name) > MAX_NAME_LEN:
            raise InvalidKeyError(f"object name longer than {MAX_NAME_LEN} bytes")
    return names


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One KV chunk's identity, as LMCache's ``CacheEngineKey`` names it, plus a tenant."""

    model: str
    world_size: int
    worker_id: int
    chunk_hash: int | str | bytes
    fmt: str = "vllm"
    namespace: str = DEFAULT_NAMESPACE

    def object_name(self) -> str:
        """The backend object name; stable across processes and versions."""
        return chunk_object_name(self.namespace, self.model, self.fmt, self.world_size, self.worker_id, self.chunk_hash)

    @classmethod
    def from_object_name(cls, name: str) -> ChunkKey:
        """Parse a name made by `object_name`; raises `InvalidKeyError` otherwise."""
        parts = check_object_name(name).split("/")
        if len(parts) != 4:
            raise InvalidKeyError(f"{name!r} is not a chunk object name (want 4 segments)")
        ns, model, group, digest = parts
        fmt, _, rest = group.rpartition("-")
        fmt, _, ws = fmt.rpartition("-")
        try:
            world_size, worker_id = int(ws), int(rest)
        except ValueError as exc:
            raise InvalidKeyError(f"{name!r}: bad '<fmt>-<world>-<worker>' segment") from exc
        return cls(
            model=unescape_component(model),
            world_size=world_size,
            worker_id=worker_id,
            chunk_hash=_parse_hash(digest),
            fmt=unescape_component(fmt),
            namespace=unescape_component(ns),
        )


def chunk_hash_of(name: str) -> int | str | bytes:
    """The chunk hash a chunk object name ends with (readable also where the name's
    other components were shortened); raises `InvalidKeyError` otherwise."""
    return _parse_hash(check_object_name(name).rpartition("/")[2])


def namespace_prefix(namespace: str, model: str | None = None) -> str:
    """The listing prefix of a namespace, or of one model inside it (ends with ``/``)."""
    prefix = escape_component(namespace) + "/"
    if model is not None:
        prefix += escape_component(model) + "/"
    return prefix


PROBE_PREFIX = "kvstore-migrate-probe/"
"""Names `kvstore migrate` writes for a moment to tell two stores apart; listings of
stored chunks (ls, stat, verify, gc, migrate) leave them out."""


def listing_prefix(prefix: str, namespace: str | None, model: str | None = None) -> str | None:
    """The one prefix that lists the names under both `prefix` and the namespace (and
    model) given: the longer of the two when one extends the other, None when they are
    disjoint (no name matches both, so nothing is listed)."""
    if namespace is None:
        return prefix
    ns_prefix = namespace_prefix(namespace, model)
    if prefix and not (prefix.startswith(ns_prefix) or ns_prefix.startswith(prefix)):
        return None
    return max(ns_prefix, prefix, key=len)
