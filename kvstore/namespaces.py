"""Tenants of a store: byte quotas and time-to-live per namespace.

Owns: `NamespaceRule` (quota, TTL) and `NamespaceBook`, the pure accounting of which
objects each namespace holds, in write order, with their sizes and write times.  A
namespace is the first segment of an object name (``tenant/model/…``).  Must not touch:
backends, placement, asyncio; times are passed in by the caller.

Quota: when a write would take a namespace over its quota, its oldest writes make room
(`over_quota`).  TTL: an object expires `ttl` seconds after it was written (`expired`).
Objects are counted once however many tiers hold copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass
from types import MappingProxyType


def namespace_of(name: str) -> str:
    """The tenant segment of an object name (everything before the first '/')."""
    return name.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class NamespaceRule:
    """Limits for one namespace: `quota` in bytes (None = none), `ttl` in seconds (None = forever)."""

    quota: int | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        if self.quota is not None and self.quota <= 0:
            raise ValueError(f"a namespace quota must be a positive byte count, not {self.quota}")
        if self.ttl is not None and self.ttl <= 0:
            raise ValueError(f"a namespace TTL must be positive seconds, not {self.ttl}")


NO_RULE = NamespaceRule()


class NamespaceBook:
    """Per-namespace holdings in write order; rules from `rules`, else `default`."""

    def __init__(
        self, rules: dict[str, NamespaceRule] | None = None, default: NamespaceRule = NO_RULE
    ) -> None:
        self.rules: Mapping[str, NamespaceRule] = MappingProxyType(dict(rules or {}))  # fixed: see `expires`
        self.default = default
        # no namespace has a TTL: nothing expires, and a lookup need not ask per name
        self.expires = default.ttl is not None or any(r.ttl is not None for r in self.rules.values())
        self._held: dict[str, OrderedDict[str, tuple[int, float]]] = {}
        self.used: dict[str, int] = {}

    def rule(self, ns: str) -> NamespaceRule:
        return self.rules.get(ns, self.default)

    def add(self, name: str, size: int, now: float) -> None:
        ns = namespace_of(name)
        held = self._held.setdefault(ns, OrderedDict())
        old = held.pop(name, None)
        if old is not None:
            self.used[ns] -= old[0]
        held[name] = (size, now)
        self.used[ns] = self.used.get(ns, 0) + size

    def discard(self, name: str) -> None:
        ns = namespace_of(name)
        held = self._held.get(ns)
        if held is None:
            return
        old = held.pop(name, None)
        if old is not None:
            self.used[ns] -= old[0]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._held.get(namespace_of(name), {})

    def is_expired(self, name: str, now: float) -> bool:
        if not self.expires:
            return False
        ttl = self.rule(namespace_of(name)).ttl
        if ttl is None:
            return False
        held = self._held.get(namespace_of(name))
        entry = held.get(name) if held is not None else None
        return entry is not None and now - entry[1] >= ttl

    def expired(self, now: float) -> list[str]:
        """Every held object past its namespace's TTL (oldest first per namespace)."""
        out = []
        for ns, held in self._held.items():
            ttl = self.rule(ns).ttl
            if ttl is None:
                continue
            for name, (_, t) in held.items():
                if now - t < ttl:
                    break  # write order is expiry order within a namespace
                out.append(name)
        return out

    def over_quota(
        self, name: str, size: int, keep: Container[str] = frozenset()
    ) -> list[str] | None:
        """Oldest objects of `name`'s namespace to drop so `size` more bytes fit its quota.

        None when even dropping everything droppable (not in `keep`) would not make room.
        """
        ns = namespace_of(name)
        quota = self.rule(ns).quota
        if quota is None:
            return []
        if size > quota:
            return None
        excess = self.used.get(ns, 0) + size - quota
        out: list[str] = []
        for held_name, (held_size, _) in self._held.get(ns, {}).items():
            if excess <= 0:
                break
            if held_name in keep or held_name == name:
                continue
            out.append(held_name)
            excess -= held_size
        return out if excess <= 0 else None

    def objects(self, ns: str) -> int:
        return len(self._held.get(ns, ()))

    def namespaces(self) -> list[str]:
        return sorted(self._held)
