"""Where a kvstore store's bytes live, as LMCache's L2 memory tags say it.

LMCache 0.5.7 asks every L2 adapter for its ``MemoryTags`` (``get_memory_tags``, an
abstract method there): the medium (``dram`` / ``storage`` …) and the residency
(``local``: on this host; ``remote``: elsewhere, or shared with other hosts).  Its
prefetch requests filter adapters by them.  LMCache 0.5.6 has no such tags and never
asks.

Owns: `StoreTags` and reading them from tier URLs (pure: no I/O, no name resolution),
and building LMCache's ``MemoryTags`` from them where LMCache has that type.  Must not
touch: opening tiers, the adapter's tasks.

From the URLs, as LMCache's own adapters tag theirs: ``mem://`` is host memory,
``file://`` local storage, a Redis reached over a unix socket local storage; a Redis or
S3 endpoint over the network is remote storage, loopback addresses included (LMCache's
resp, valkey and s3 adapters always say remote, and a loopback port may be a tunnel to
another host); a scheme registered by someone else is remote (nothing says where it keeps
its bytes).  A store is ``dram`` when every tier is memory and ``remote`` when any tier
is.  LMCache's own ``"shared": true`` on the ``--l2-adapter`` spec (a pool other hosts
mount too) makes it remote, and the adapter's ``residency`` setting says which outright.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

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


def tier_tags(url: str) -> StoreTags:
    """Where the tier at ``url`` keeps its bytes (see the module docstring)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "mem":
        return StoreTags("dram", "local")
    if scheme in ("file", "unix"):
        return StoreTags("storage", "local")
    return StoreTags("storage", "remote")


def store_tags(urls: Iterable[str], residency: Residency | None = None, *, shared: bool = False) -> StoreTags:
    """The tags of a store whose tiers are at ``urls``; ``shared`` (LMCache's flag) makes
    it remote; ``residency`` overrides both."""
    tiers = [tier_tags(u) for u in urls]
    segment: Segment = "dram" if tiers and all(t.segment == "dram" for t in tiers) else "storage"
    if residency is None:
        residency = "remote" if shared or any(t.residency == "remote" for t in tiers) else "local"
    return StoreTags(segment, residency)


__all__ = ["RESIDENCIES", "Residency", "StoreTags", "store_tags", "tier_tags"]
