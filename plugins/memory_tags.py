"""Where a kvstore store's bytes live, as LMCache's L2 memory tags say it.

LMCache 0.5.7 asks every L2 adapter for its ``MemoryTags`` (``get_memory_tags``, an
abstract method there): the medium (``dram`` / ``storage`` …) and the residency
(``local``: on this host; ``remote``: elsewhere, or shared with other hosts).  Its
prefetch requests filter adapters by them.  LMCache 0.5.6 has no such tags and never
asks.

Owns: `StoreTags` and reading them from tier URLs (pure: no I/O, no name resolution),
and building LMCache's ``MemoryTags`` from them where LMCache has that type.  Must not
touch: opening tiers, the adapter's tasks.

From the URLs: ``mem://`` is host memory; ``file://`` is local storage; a Redis or an
S3 endpoint is local storage when it is reached over a unix socket or a loopback
address, remote otherwise (S3 without ``endpoint_url`` is AWS: remote); a scheme
registered by someone else is remote (nothing says where it keeps its bytes).  A store
is ``dram`` when every tier is memory and ``remote`` when any tier is.  Where that
guess is wrong (a ``file://`` directory other hosts mount too, a Redis on this host
reached by a routable address), the adapter's ``residency`` setting says which.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

Segment = Literal["dram", "storage"]
Residency = Literal["local", "remote"]
RESIDENCIES: tuple[Residency, ...] = ("local", "remote")


@dataclass(frozen=True, slots=True)
class StoreTags:
    """A store's medium and residency, in LMCache's enum values' spelling."""

    segment: Segment
    residency: Residency

    def to_lmcache(self) -> Any:
        """LMCache's ``MemoryTags`` (LMCache 0.5.7 and later); RuntimeError before that."""
        try:
            from lmcache.v1.distributed import api
        except ImportError as exc:  # pragma: no cover - lmcache is installed wherever this runs
            raise RuntimeError(f"LMCache's MP API is not importable: {exc}") from None
        tags, segment, residency = (getattr(api, n, None) for n in ("MemoryTags", "MemorySegment", "MemoryResidency"))
        if tags is None or segment is None or residency is None:
            raise RuntimeError("this LMCache has no L2 memory tags (they came with LMCache 0.5.7)")
        return tags(segment(self.segment), residency(self.residency))


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tier_tags(url: str) -> StoreTags:
    """Where the tier at ``url`` keeps its bytes (see the module docstring)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "mem":
        return StoreTags("dram", "local")
    if scheme == "file":
        return StoreTags("storage", "local")
    if scheme == "unix":
        return StoreTags("storage", "local")
    if scheme in ("redis", "rediss"):
        return StoreTags("storage", "local" if _loopback(parts.hostname) else "remote")
    if scheme in ("redis+cluster", "rediss+cluster"):
        hosts = parts.netloc.rsplit("@", 1)[-1].split(",")
        local = all(_loopback(h.strip().rpartition(":")[0]) for h in hosts)
        return StoreTags("storage", "local" if local else "remote")
    if scheme == "s3":
        endpoint = dict(parse_qsl(parts.query)).get("endpoint_url")
        local = endpoint is not None and _loopback(urlsplit(endpoint).hostname)
        return StoreTags("storage", "local" if local else "remote")
    return StoreTags("storage", "remote")


def store_tags(urls: Iterable[str], residency: Residency | None = None) -> StoreTags:
    """The tags of a store whose tiers are at ``urls``; ``residency`` overrides the
    residency read from them."""
    tiers = [tier_tags(u) for u in urls]
    segment: Segment = "dram" if tiers and all(t.segment == "dram" for t in tiers) else "storage"
    if residency is None:
        residency = "remote" if any(t.residency == "remote" for t in tiers) else "local"
    return StoreTags(segment, residency)


__all__ = ["RESIDENCIES", "Residency", "StoreTags", "store_tags", "tier_tags"]
