"""Where kvstore's Prometheus metrics are scraped: LMCache's endpoint, and an opt-in port.

Owns: one process-wide collector (`HUB`) that gathers the metrics of every live store
attached to it (each store keeps its own `StoreMetrics` registry) under one set of
names, with a ``store`` label telling the stores of a process apart, plus what is read
at scrape time: tier identity, circuit-breaker states, backend error kinds and the
counters of the plugin or L2 adapter that owns the store; its registration in
prometheus_client's default registry (once per process, so several stores never cause
a "Duplicated timeseries" error); and the opt-in HTTP server (``KVSTORE_METRICS_PORT``
or the L2 adapter's ``metrics_port``) that serves the kvstore metrics alone.
Must not touch: the stores' behaviour (it only reads them, and a failing read skips a
family for one scrape), placement, I/O beyond the HTTP server.

Why the default registry: LMCache 0.5.6's MP server run as
``python -m lmcache.v1.multiprocess.server`` serves ``prometheus_client.REGISTRY`` on
``--prometheus-port`` (9090) when it has no OTLP endpoint
(``lmcache/v1/mp_observability/otel_init.py`` calls ``start_http_server(port)``; its OTel
meters reach that registry through ``PrometheusMetricReader``), and LMCache's internal
API server (in-process mode) serves it at ``/metrics``.  ``lmcache server`` (the HTTP
front end) serves no Prometheus endpoint at all: there, and with OTLP, use the port.

Names are documented in docs/operations.md.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from kvstore.tiered import TieredStore

log = logging.getLogger(__name__)

ENV_PORT = "KVSTORE_METRICS_PORT"
ENV_ADDR = "KVSTORE_METRICS_ADDR"
DEFAULT_ADDR = "0.0.0.0"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


def parse_port(value: Any, what: str = ENV_PORT) -> int | None:
    """A TCP port from a setting (None / "" = no port; 0 = any free port)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{what}: cannot read {value!r} as a TCP port (0-65535)") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{what}: {port} is not a TCP port (0-65535)")
    return port


@dataclass
class _Source:
    label: str
    store: weakref.ReferenceType[TieredStore]
    plugin: Any = None  # a StoreRuntime: .counters (dataclass), .pending_bytes
    adapter: Any = None  # a KVStoreL2Adapter: .counters (dataclass)
    extra: dict[str, Any] = field(default_factory=dict)


class KVStoreCollector(Collector):
    """Every attached store's metrics, with a ``store`` label; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, _Source] = {}

    # ------------------------------------------------------------ attaching
    def attach(
        self, store: TieredStore, *, name: str = "kvstore", plugin: Any = None, adapter: Any = None
    ) -> str:
        """Export `store` (again: only the owners given now are added); returns its label."""
        key = id(store)
        with self._lock:
            self._prune()
            src = self._sources.get(key)
            if src is None or src.store() is not store:
                taken = {s.label for s in self._sources.values()}
                label, n = name, 1
                while label in taken:
                    n += 1
                    label = f"{name}-{n}"
                src = self._sources[key] = _Source(label, weakref.ref(store))
            if plugin is not None:
                src.plugin = plugin
            if adapter is not None:
                src.adapter = adapter
            return src.label

    def detach(self, store: TieredStore) -> None:
        with self._lock:
            self._sources.pop(id(store), None)

    def labels(self) -> list[str]:
        with self._lock:
            self._prune()
            return sorted(s.label for s in self._sources.values())

    def _prune(self) -> None:
        for key in [k for k, s in self._sources.items() if s.store() is None]:
            del self._sources[key]

    # ------------------------------------------------------------ collecting
    def describe(self) -> Iterable[Metric]:
        return []  # names vary with what is attached; no collision check at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._prune()
            sources = [(s, s.store()) for s in self._sources.values()]
        merged: dict[str, Metric] = {}
        extra = _Extra()
        for src, store in sources:
            if store is None:
                continue
            try:
                for fam in store.metrics.registry.collect():
                    out = merged.get(fam.name)
                    if out is None:
                        out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    for s in fam.samples:
                        out.samples.append(
                            Sample(s.name, {**s.labels, "store": src.label}, s.value, s.timestamp, s.exemplar)
                        )
            except Exception as exc:  # a scrape never fails because one store could not be read
                log.debug("kvstore metrics: reading %s failed: %s", src.label, exc)
            extra.add(src, store)
        yield from merged.values()
        yield from extra.families()


class _Extra:
    """Families read from the stores' objects at scrape time."""

    def __init__(self) -> None:
        self.tier_info = GaugeMetricFamily(
            "kvstore_tier_info",
            "A tier of a store: its (redacted) URL, codec and backend kind; value 1",
            labels=["store", "tier", "url", "codec", "backend"],
        )
        self.breaker = GaugeMetricFamily(
            "kvstore_breaker_state",
            "Circuit breaker of a tier (the store's deadline guard, or the backend's own, the worse of"
            " the two): 0 closed, 1 half-open (probing), 2 open (failing fast)",
            labels=["store", "tier"],
        )
        self.backend_errors = CounterMetricFamily(
            "kvstore_backend_errors",
            "Backend faults by kind (put, get, and the S3 backend's timeout, throttled, breaker_open, ...)",
            labels=["store", "tier", "kind"],
        )
        self.tier_misses = CounterMetricFamily(
            "kvstore_tier_misses",
            "Reads a tier was asked for and could not serve (absent, corrupt or undecodable)",
            labels=["store", "tier"],
        )
        self.pending = GaugeMetricFamily(
            "kvstore_plugin_pending_bytes",
            "Bytes of plugin writes in flight (max_pending bounds it)",
            labels=["store"],
        )
        self.counters: dict[str, CounterMetricFamily] = {}
        self.gauges: dict[str, GaugeMetricFamily] = {}

    def add(self, src: _Source, store: TieredStore) -> None:
        for fn in (self._tiers, self._owners):
            try:
                fn(src, store)
            except Exception as exc:
                log.debug("kvstore metrics: %s of %s failed: %s", fn.__name__, src.label, exc)

    def _tiers(self, src: _Source, store: TieredStore) -> None:
        guards = getattr(store, "breakers", [None] * len(store.tiers))
        for name, tier, guard in zip(store.tier_names, store.tiers, guards):
            backend = tier.backend
            self.tier_info.add_metric(
                [src.label, name, tier.name, tier.codec.name, type(backend).__name__], 1
            )
            self.tier_misses.add_metric([src.label, name], float(tier.counters.misses))
            states = [_breaker_value(b) for b in (guard, getattr(backend, "breaker", None)) if b is not None]
            if states:
                self.breaker.add_metric([src.label, name], max(states))
            c = backend.counters
            kinds: dict[str, float] = {"put": c.put_errors, "get": c.get_errors}
            errors = getattr(backend, "errors", None)
            if isinstance(errors, dict):
                kinds.update({str(k): float(v) for k, v in list(errors.items())})
            for kind, value in kinds.items():
                self.backend_errors.add_metric([src.label, name, kind], value)

    def _owners(self, src: _Source, store: TieredStore) -> None:
        if src.plugin is not None:
            self._dataclass("kvstore_plugin", "plugin", src.label, src.plugin.counters)
            self.pending.add_metric([src.label], float(src.plugin.pending_bytes))
        if src.adapter is not None:
            self._dataclass("kvstore_l2", "L2 adapter", src.label, src.adapter.counters)
            locked = getattr(src.adapter, "_locks", None)
            if locked is not None:
                g = self.gauges.setdefault(
                    "kvstore_l2_locked",
                    GaugeMetricFamily("kvstore_l2_locked", "Objects held by lookup locks", labels=["store"]),
                )
                g.add_metric([src.label], float(len(locked)))

    def _dataclass(self, prefix: str, who: str, label: str, counters: Any) -> None:
        if not is_dataclass(counters) or isinstance(counters, type):
            return
        for key, value in asdict(counters).items():
            name = f"{prefix}_{key}"
            fam = self.counters.get(name)
            if fam is None:
                fam = self.counters[name] = CounterMetricFamily(
                    name, f"The {who}'s {key.replace('_', ' ')} count", labels=["store"]
                )
            fam.add_metric([label], float(value))

    def families(self) -> Iterator[Metric]:
        for fam in (
            self.tier_info,
            self.tier_misses,
            self.breaker,
            self.backend_errors,
            self.pending,
        ):
            if fam.samples:
                yield fam
        yield from self.counters.values()
        yield from self.gauges.values()


def _breaker_value(breaker: Any) -> float:
    state = getattr(breaker, "state", None)
    return float(BREAKER_STATES.get(str(getattr(state, "value", state)).replace("-", "_"), -1))


HUB = KVStoreCollector()
REGISTRY_FOR_PORT = CollectorRegistry(auto_describe=False)
REGISTRY_FOR_PORT.register(HUB)

_lock = threading.Lock()
_in_default = False
_server: Any = None
_server_port: int | None = None


def register_default(registry: CollectorRegistry = REGISTRY) -> None:
    """Put the hub into prometheus_client's default registry (once per process)."""
    global _in_default
    with _lock:
        if _in_default and registry is REGISTRY:
            return
        try:
            registry.register(HUB)
        except ValueError as exc:  # already there (registered by another path)
            log.debug("kvstore metrics: %s", exc)
        if registry is REGISTRY:
            _in_default = True


def serve(port: int, addr: str | None = None) -> int | None:
    """Serve the kvstore metrics on ``addr:port/metrics`` (0 = a free port); the port, or
    None when it could not be opened (logged with the fix; the cache keeps working).
    One server per process: a later call with another port keeps the first one."""
    global _server, _server_port
    from prometheus_client import start_http_server

    with _lock:
        if _server is not None:
            if port not in (0, _server_port):
                log.warning(
                    "kvstore metrics already served on port %s; %s=%s ignored", _server_port, ENV_PORT, port
                )
            return _server_port
        addr = addr or os.environ.get(ENV_ADDR) or DEFAULT_ADDR
        try:
            _server, _thread = start_http_server(port, addr=addr, registry=REGISTRY_FOR_PORT)
        except OSError as exc:
            log.error(
                "kvstore metrics: cannot listen on %s:%s (%s); pick a free port in %s / metrics_port",
                addr,
                port,
                exc.strerror or exc,
                ENV_PORT,
            )
            return None
        _server_port = int(_server.server_port)
        log.info("kvstore metrics on http://%s:%d/metrics", addr, _server_port)
        return _server_port


def served_port() -> int | None:
    """The port the kvstore metrics server listens on, if one was started."""
    return _server_port


def stop_serving() -> None:
    """Stop the metrics server (tests; a process normally keeps it until exit)."""
    global _server, _server_port
    with _lock:
        if _server is not None:
            _server.shutdown()
            _server.server_close()
        _server, _server_port = None, None


def export_store(
    store: TieredStore,
    *,
    name: str = "kvstore",
    plugin: Any = None,
    adapter: Any = None,
    port: int | None = None,
    default_registry: bool = True,
) -> str:
    """Make `store`'s metrics scrapeable: attach it to the hub, register the hub in the
    default registry, and serve the port given (or ``KVSTORE_METRICS_PORT``) if any.
    Never raises for a bad port setting (logged): metrics must not stop the cache."""
    label = HUB.attach(store, name=name, plugin=plugin, adapter=adapter)
    if default_registry:
        register_default()
    if port is None:
        try:
            port = parse_port(os.environ.get(ENV_PORT))
        except ValueError as exc:
            log.error("kvstore metrics: %s; no metrics port", exc)
    if port is not None:
        serve(port)
    return label


def forget_store(store: TieredStore) -> None:
    """Stop exporting `store` (it is closed)."""
    HUB.detach(store)


__all__ = [
    "ENV_ADDR",
    "ENV_PORT",
    "HUB",
    "KVStoreCollector",
    "export_store",
    "forget_store",
    "parse_port",
    "register_default",
    "serve",
    "served_port",
    "stop_serving",
]
