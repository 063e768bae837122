"""Prometheus metrics of a `TieredStore`, in a registry of its own.

Owns: metric names, labels and the small helpers the store calls.  Must not touch:
placement or I/O.  Each store gets its own `CollectorRegistry` (several stores, or
tests, in one process never collide); expose it with `text()` or by handing
`registry` to a prometheus-client exporter.  The plugins and the L2 adapter export
their store through `kvstore.metrics_export` (default registry with a ``store`` label,
opt-in port); docs/operations.md lists every name.

Metrics (all prefixed ``kvstore_``):

* ``hits_total{tier,namespace}``, ``misses_total{namespace}``
* ``bytes_in_total{tier,namespace}`` (written), ``bytes_out_total{tier,namespace}`` (read)
* ``op_seconds{op,tier}`` histogram of backend batch latency (get, put, delete, copy)
* ``evictions_total{tier}``, ``moves_total{kind,tier}`` (promote/demote, into `tier`)
* ``errors_total{op,tier}``, ``quarantines_total{tier}``
* ``quota_evictions_total{namespace}``, ``expired_total{namespace}``
* gauges ``tier_bytes{tier}``, ``tier_objects{tier}``, ``namespace_bytes{namespace}``, ``moves_in_flight``
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.hits = Counter("kvstore_hits", "Objects served, by tier", ["tier", "namespace"], registry=r)
        self.misses = Counter("kvstore_misses", "Objects asked for and not served", ["namespace"], registry=r)
        self.bytes_in = Counter(
            "kvstore_bytes_in", "Bytes written into a tier", ["tier", "namespace"], registry=r
        )
        self.bytes_out = Counter(
            "kvstore_bytes_out", "Bytes read from a tier", ["tier", "namespace"], registry=r
        )
        self.op_seconds = Histogram(
            "kvstore_op_seconds", "Backend batch latency", ["op", "tier"], buckets=_BUCKETS, registry=r
        )
        self.evictions = Counter("kvstore_evictions", "Objects evicted from a tier", ["tier"], registry=r)
        self.moves = Counter(
            "kvstore_moves", "Copies between tiers, by destination", ["kind", "tier"], registry=r
        )
        self.errors = Counter("kvstore_errors", "Failed backend operations", ["op", "tier"], registry=r)
        self.quarantines = Counter(
            "kvstore_quarantines", "Corrupt objects taken out of service", ["tier"], registry=r
        )
        self.quota_evictions = Counter(
            "kvstore_quota_evictions",
            "Objects dropped to keep a namespace in its quota",
            ["namespace"],
            registry=r,
        )
        self.expired = Counter(
            "kvstore_expired", "Objects dropped when their TTL ran out", ["namespace"], registry=r
        )
        self.tier_bytes = Gauge("kvstore_tier_bytes", "Bytes held by a tier", ["tier"], registry=r)
        self.tier_objects = Gauge("kvstore_tier_objects", "Objects held by a tier", ["tier"], registry=r)
        self.namespace_bytes = Gauge(
            "kvstore_namespace_bytes", "Bytes held by a namespace", ["namespace"], registry=r
        )
        self.moves_in_flight = Gauge("kvstore_moves_in_flight", "Background copies under way", registry=r)

    def text(self) -> str:
        """The Prometheus exposition text of this store's metrics."""
        return generate_latest(self.registry).decode()
