"""`kvstore doctor`: check a configuration exactly as the plugins or the MP adapter will use it.

Owns: finding the configuration (in-process: LMCache's own config, i.e. ``LMCACHE_*`` or
``LMCACHE_CONFIG_FILE``, with ``LMCACHE_EXTRA_CONFIG``, ``KVSTORE_*`` and a kvstore
config file; MP mode: the ``--l2-adapter`` JSON as given to ``lmcache server``); handing
it to the validation the plugins run (`kvstore_lmcache.runtime.load_config`, or LMCache's
``--l2-adapter`` parser and `KVStoreL2AdapterConfig.from_dict`); opening the store they
would open; one verified probe round trip per tier; what reuse across restarts and
servers needs (hashing, sharing, budgets); the report (text or ``--json``) and its exit
code.  Must not touch: objects other than its own probe (one reserved name per tier,
deleted afterwards), validation rules (kvstore/store_config.py, plugins/l2_adapter.py),
LMCache's runtime (no engine is built).

Exit codes: 0 every check passed (warnings allowed); 1 a check failed (a tier cannot be
reached or used, a round trip failed, LMCache would refuse the plugin); 2 the
configuration is invalid.  The last line names what failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click

EXIT_FAILED, EXIT_CONFIG = 1, 2
PROBE_MODEL = "~kvstore-doctor"  # reserved: no LMCache model name starts with '~'
PROBE_SHAPE = (2, 4, 16, 32)  # a tiny KV-like chunk, 8 KiB in bfloat16

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Report:
    mode: str
    source: str
    checks: list[Check] = field(default_factory=list)
    config: dict[str, Any] | None = None
    exit_code: int = 0

    def add(self, name: str, status: str, detail: str, fix: str = "") -> Check:
        check = Check(name, status, detail, fix)
        self.checks.append(check)
        return check

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "exit_code": self.exit_code,
            "mode": self.mode,
            "source": self.source,
            "config": self.config,
            "checks": [asdict(c) for c in self.checks],
            "failed": [c.name for c in self.failed],
            "warnings": [c.name for c in self.checks if c.status == WARN],
        }


class ConfigInvalid(Exception):
    """The configuration cannot be used at all; the report says why."""


# ---------------------------------------------------------------------------- sources
@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """Set one environment variable for the duration (as the server's environment would)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Silence loggers whose messages the report carries anyway."""
    loggers = [logging.getLogger(n) for n in names]
    old = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, o in zip(loggers, old):
            lg.disabled = o


def _lmcache_config() -> Any:
    """LMCache's engine config, read as its vLLM integration reads it."""
    from lmcache.v1.config import LMCacheEngineConfig

    path = os.environ.get("LMCACHE_CONFIG_FILE")
    if path:
        cfg = LMCacheEngineConfig.from_file(path)
        cfg.update_config_from_env()
    else:
        cfg = LMCacheEngineConfig.from_env()
    return cfg


def in_process_config(report: Report) -> tuple[Any, dict[str, Any]]:
    """(StoreConfig, facts) for the in-process plugins; raises `ConfigInvalid`."""
    from kvstore_lmcache.runtime import load_config

    facts: dict[str, Any] = {"plugin": None}
    raw_extra = os.environ.get("LMCACHE_EXTRA_CONFIG")
    if raw_extra is not None:
        try:
            json.loads(raw_extra)
        except json.JSONDecodeError as exc:
            report.add(
                "LMCACHE_EXTRA_CONFIG",
                FAIL,
                f"not valid JSON ({exc}); LMCache ignores all of it and runs without kvstore",
                "write it as one JSON object, keys and strings in double quotes",
            )
            raise ConfigInvalid from None
    lm: Any = None
    if importlib.util.find_spec("lmcache") is None:
        report.add("LMCache", WARN, "lmcache is not installed here: checking kvstore's own settings only")
        extra = json.loads(raw_extra) if raw_extra else {}
    else:
        try:
            with _quiet("lmcache"):
                lm = _lmcache_config()
        except Exception as exc:
            report.add(
                "LMCache config",
                FAIL,
                f"LMCache cannot read its configuration: {type(exc).__name__}: {exc}",
                "fix the LMCACHE_* variable or LMCACHE_CONFIG_FILE it names",
            )
            raise ConfigInvalid from None
        extra = dict(getattr(lm, "extra_config", None) or {})
        _plugin_path(report, lm, extra, facts)
    blocking = getattr(lm, "blocking_timeout_secs", None)
    facts["blocking_timeout_secs"] = blocking
    facts["pre_caching_hash_algorithm"] = getattr(lm, "pre_caching_hash_algorithm", None)
    facts["internal_api_server_enabled"] = bool(getattr(lm, "internal_api_server_enabled", False))
    facts["internal_api_server_port_start"] = getattr(lm, "internal_api_server_port_start", None)
    from kvstore.store_config import StoreConfigError

    try:
        with _quiet("kvstore.plugins"):
            cfg = load_config(extra, blocking, f"{facts['plugin'] or 'plugin'}")
    except StoreConfigError as exc:
        report.add("kvstore settings", FAIL, str(exc), "change the setting named above")
        raise ConfigInvalid from None
    return cfg, facts


def _plugin_path(report: Report, lm: Any, extra: dict[str, Any], facts: dict[str, Any]) -> None:
    """Which kvstore path LMCache will load, and what LMCache needs for it."""
    found = []
    for attr, key, module in (
        ("storage_plugins", "storage_plugin", "kvstore_lmcache.storage_plugin"),
        ("remote_storage_plugins", "remote_storage_plugin", "kvstore_lmcache.remote_connector"),
    ):
        for name in getattr(lm, attr, None) or []:
            if extra.get(f"{key}.{name}.module_path") == module:
                found.append((attr, name, module))
    if not found:
        report.add(
            "LMCache plugin",
            WARN,
            "LMCache is not configured to load kvstore (no storage or remote plugin with "
            "module_path kvstore_lmcache.storage_plugin / kvstore_lmcache.remote_connector); checked kvstore's settings only",
            "set LMCACHE_STORAGE_PLUGINS=kvstore and storage_plugin.kvstore.module_path / class_name "
            "in LMCACHE_EXTRA_CONFIG (docs/lmcache.md)",
        )
        return
    attr, name, module = found[0]
    facts["plugin"] = "storage plugin" if attr == "storage_plugins" else "remote connector"
    detail = f"LMCache loads {module} as {attr[:-1].replace('_', ' ')} {name!r}"
    if float(getattr(lm, "max_local_cpu_size", 0) or 0) <= 0:
        report.add(
            "LMCache plugin",
            FAIL,
            f"{detail}, but LMCACHE_MAX_LOCAL_CPU_SIZE is 0: the plugin needs LMCache's CPU backend "
            "as its allocator and refuses to load",
            "set LMCACHE_MAX_LOCAL_CPU_SIZE > 0 (LMCACHE_LOCAL_CPU may stay False)",
        )
        return
    serde = getattr(lm, "remote_serde", "naive")
    if attr == "remote_storage_plugins" and serde not in (None, "naive"):
        report.add(
            "LMCache plugin",
            FAIL,
            f"{detail}, but LMCACHE_REMOTE_SERDE={serde!r}: the connector refuses to load",
            "set LMCACHE_REMOTE_SERDE=naive and kvstore.cold_codec=cachegen to compress in kvstore",
        )
        return
    report.add("LMCache plugin", OK, detail)


def mp_config(report: Report, raw: str) -> tuple[Any, dict[str, Any]]:
    """(StoreConfig, facts) from an ``--l2-adapter`` JSON, parsed as ``lmcache server`` does."""
    import argparse

    text = raw
    if not raw.lstrip().startswith("{") and Path(raw).is_file():
        text = Path(raw).read_text()
    try:
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
        from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import (
            PluginL2AdapterConfig,
            _resolve_config_class,
        )
    except ImportError as exc:
        report.add("--l2-adapter", FAIL, f"LMCache's L2 adapter support cannot be imported: {exc}")
        raise ConfigInvalid from None
    try:
        with _quiet("lmcache"):
            parsed = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[text]))
    except (KeyError, ValueError) as exc:
        report.add("--l2-adapter", FAIL, f"lmcache server would refuse it: {exc}", _ADAPTER_FIX)
        raise ConfigInvalid from None
    outer = parsed.adapters[0]
    if not isinstance(outer, PluginL2AdapterConfig) or outer.module_path not in (
        "kvstore_lmcache.l2_adapter",
        "plugins.l2_adapter",  # the import name before 0.2; still loads
    ):
        report.add(
            "--l2-adapter",
            FAIL,
            f"not kvstore's adapter (type {getattr(outer, 'module_path', type(outer).__name__)!r})",
            _ADAPTER_FIX,
        )
        raise ConfigInvalid from None
    try:  # what lmcache server does when it creates the adapter, short of creating it
        module = importlib.import_module(outer.module_path)
        adapter_cls = getattr(module, outer.class_name)
        cfg_cls = _resolve_config_class(module, outer, adapter_cls)
        if cfg_cls is None:
            raise ValueError(f"{outer.module_path} has no config class for {outer.class_name}")
        adapter_cfg = cfg_cls.from_dict(outer.adapter_params)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        report.add("--l2-adapter", FAIL, f"lmcache server would refuse it: {exc}", _ADAPTER_FIX)
        raise ConfigInvalid from None
    report.add("--l2-adapter", OK, f"{outer.module_path}.{outer.class_name}, adapter_params accepted")
    facts = {
        "plugin": "MP L2 adapter",
        "lock_ttl_s": adapter_cfg.lock_ttl_s,
        "metrics_port": getattr(adapter_cfg, "metrics_port", None),
    }
    return adapter_cfg.store, facts


_ADAPTER_FIX = (
    '\'{"type": "plugin", "module_path": "kvstore_lmcache.l2_adapter", "class_name": "KVStoreL2Adapter", '
    '"adapter_params": {"tiers": [...]}}\' (see plugins/l2_adapter.py)'
)


# ------------------------------------------------------------------------------ tiers
def _fix_for(url: str, exc: BaseException | str) -> str:
    """What to do about a tier that cannot be opened or used."""
    scheme = urlsplit(url).scheme
    text = str(exc).lower()
    if scheme == "file":
        path = unquote(urlsplit(url).path)
        if (isinstance(exc, OSError) and exc.errno == 28) or "no space" in text:
            return f"free space on the file system of {path}, or lower ?capacity="
        return (
            f"make {path} a directory this user can write (mkdir -p {path}; chown/chmod), "
            "or point the file:// URL at one"
        )
    if scheme.startswith("redis") or scheme == "unix":
        if "no permissions" in text or "noperm" in text:
            return (
                "give the ACL user every key under the tier's prefix (~kv:* for the default prefix) and the "
                "commands kvstore sends (+@read +@write +@keyspace +@scripting, or +@all)"
            )
        if "auth" in text or "password" in text:
            return "fix the password / ACL user in the URL (redis://user:pass@host) or KVSTORE_REDIS_PASSWORD"
        return "start redis-server there, or fix host:port / socket path in the URL (redis-cli -u URL ping)"
    if scheme == "s3":
        if "credential" in text or "denied" in text or "signature" in text or "access key" in text:
            return "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key that may read, write, list"
        if "does not exist" in text or "nosuchbucket" in text:
            return "create the bucket, or fix its name in the URL"
        return "check endpoint_url= and region= in the URL, and that the S3 server is running"
    return "check the tier URL"


def _probe_name(namespace: str) -> str:
    from kvstore.keys import ChunkKey

    return ChunkKey(PROBE_MODEL, 1, 0, secrets.randbits(62), fmt="probe", namespace=namespace).object_name()


async def _open_tiers(report: Report, cfg: Any) -> tuple[Any, list[Any]]:
    """(the store the plugins open (`StoreConfig.build`), its tiers).  When it cannot be
    opened: (None, each tier opened alone, or the failed `Check` where that fails)."""
    from kvstore.tier import Tier

    try:
        store = cfg.build()
        return store, list(store.tiers)
    except Exception as exc:
        first = exc
    tiers: list[Any] = []
    for i, t in enumerate(cfg.tiers):
        try:
            tiers.append(Tier.open(t.backend_url, t.codec))
        except Exception as exc:
            tiers.append(
                Check(
                    f"tier{i} {t.redacted()}",
                    FAIL,
                    f"cannot be opened: {type(exc).__name__}: {_redact(exc)}",
                    _fix_for(t.url, exc),
                )
            )
    if not any(isinstance(t, Check) for t in tiers):
        report.add("store", FAIL, f"the store cannot be opened: {type(first).__name__}: {_redact(first)}")
    return None, tiers


def _redact(exc: BaseException | str) -> str:
    from kvstore.redact import redact_text

    return redact_text(str(exc))


async def check_tiers(report: Report, cfg: Any, timeout: float) -> Any:
    """Reach every tier and round-trip one probe chunk through it; returns the store (or None)."""
    store, tiers = await _open_tiers(report, cfg)
    for i, tier in enumerate(tiers):
        if isinstance(tier, Check):
            report.checks.append(tier)
            continue
        url = cfg.tiers[i].url
        name = f"tier{i} {cfg.tiers[i].redacted()}"
        try:
            status, detail, fix = await asyncio.wait_for(_probe(tier, cfg), timeout)
        except asyncio.TimeoutError:
            status, detail, fix = FAIL, f"no answer within {timeout:g}s", _fix_for(url, "timeout")
        except Exception as exc:
            status, detail, fix = FAIL, f"{type(exc).__name__}: {_redact(exc)}", _fix_for(url, exc)
        report.add(name, status, detail, fix)
        if store is None:
            await tier.close()
    return store


async def _probe(tier: Any, cfg: Any) -> tuple[str, str, str]:
    """Check, write a probe, read it back verified (frame checksum + key), delete it."""
    import torch

    from kvstore.backends.base import BackendUnavailableError
    from kvstore.tier import Tier

    backend = tier.backend
    url = backend.url
    try:
        await backend.check()
    except BackendUnavailableError as exc:
        return FAIL, _redact(exc), _fix_for(url, exc)
    # raw frames: every tier reads any codec, and a model-bound codec would refuse a probe
    probe = Tier(backend, "raw", name=tier.name)
    name = _probe_name(cfg.namespace)
    data = torch.randn(PROBE_SHAPE).to(torch.bfloat16)
    t0 = time.perf_counter()
    (ok,) = await probe.put_many([(name, data)], layout="probe")
    t1 = time.perf_counter()
    if not ok:
        return (
            FAIL,
            f"writing a {data.nbytes}-byte probe failed ({_backend_error(backend)})",
            _fix_for(url, _backend_error(backend)),
        )
    try:
        # read back as a store reads for LMCache: into a tensor (streamed where the backend
        # streams: S3's presigned GETs, Redis's raw sockets, mapped disk reads); checksum and key checked
        (got,) = await probe.get_many([name], out=[torch.empty_like(data)])
        t2 = time.perf_counter()
        if got is None:
            return (
                FAIL,
                "the probe was written but does not read back (missing or failed its checks)",
                (
                    "another process may be deleting objects under this prefix, or the backend lost the "
                    "write; see the log above"
                ),
            )
        if got.shape != data.shape or got.dtype != data.dtype or not torch.equal(got, data):
            return (
                FAIL,
                "the probe read back with different contents",
                "report this: a tier must return what it stored",
            )
    finally:
        deleted = await probe.delete_many([name])
    still = (await probe.contains_many([name]))[0]
    if still:
        return (
            FAIL,
            f"the probe could not be deleted (left behind: {name})",
            "give the credentials delete permission on this prefix",
        )
    codec = tier.codec.name
    note = "" if codec == "raw" else f"; tier codec {codec} loaded (probe written raw)"
    publishing = getattr(backend, "check_publishing", None)  # Redis: big values hashed as sent
    refusal = await publishing(name) if publishing is not None else None
    if refusal:
        return (
            WARN,
            f"reached, probe written and read back verified; but big values are checksummed before they "
            f"are sent (a second pass over each, stores a few percent slower): {_redact(refusal)}",
            "let the Redis user run scripts (ACL +@scripting) and use every key under its prefix "
            "(~kv:* for the default prefix: objects, their :parts and :tmp: keys); see docs/operations.md",
        )
    if backend.capabilities.streamed_reads:
        note += "; read back streamed into a tensor"
    if not deleted or not deleted[0]:
        note += "; delete reported no object"
    return (
        OK,
        f"reached; probe written {1e3 * (t1 - t0):.1f} ms, read back verified {1e3 * (t2 - t1):.1f} ms, deleted{note}",
        "",
    )


def _backend_error(backend: Any) -> str:
    st = backend.stats()
    extra = st.extra or {}
    for key in ("last_open_error", "last_error"):
        if extra.get(key):
            return str(extra[key])
    errors = extra.get("errors")
    if errors:
        return ", ".join(f"{k}={v}" for k, v in dict(errors).items() if v)
    return "see the log above"


# ------------------------------------------------------------------ reuse and budgets
def check_reuse(report: Report, cfg: Any, facts: dict[str, Any], store: Any) -> None:
    """Hashing, sharing across processes / hosts / restarts, and byte budgets."""
    mode = report.mode
    if mode == "mp":
        report.add(
            "chunk hashes",
            OK,
            "LMCache's MP server hashes chunks as blake3 of the token ids (lmcache server "
            "--hash-algorithm, default blake3): the same on every server and after restarts, "
            "whatever PYTHONHASHSEED is; keep --hash-algorithm and --chunk-size equal on every server",
        )
    else:
        seed = os.environ.get("PYTHONHASHSEED")
        vllm = importlib.util.find_spec("vllm") is not None
        algo = facts.get("pre_caching_hash_algorithm")
        algo_txt = f" (LMCache pre_caching_hash_algorithm={algo})" if algo else ""
        if seed is None:
            where = "vLLM is installed here" if vllm else "if these servers run vLLM"
            report.add(
                "PYTHONHASHSEED",
                WARN,
                f"unset; {where}: vLLM starts every chunk-hash chain from a random NONE_HASH unless "
                f"PYTHONHASHSEED is set, so after a restart (or on another server) no chunk is ever "
                f"reused{algo_txt}",
                "export PYTHONHASHSEED=0 (any value, the same on every vLLM server) before starting vLLM",
            )
        else:
            report.add(
                "PYTHONHASHSEED",
                OK,
                f"{seed!r}: chunk keys survive restarts; every server sharing these tiers must use the "
                f"same value{algo_txt}",
            )
    report.add(
        "namespace",
        INFO,
        f"objects live under '{cfg.namespace}/<model>/': servers share chunks only with the same "
        "namespace, model name, chunk size and (in-process) world size",
    )
    persistent = []
    for i, t in enumerate(cfg.tiers):
        scheme = urlsplit(t.url).scheme
        if scheme == "mem":
            scope = "this process only; empty after a restart"
        elif scheme == "file":
            path = unquote(urlsplit(t.url).path)
            scope = f"every process on this host that uses {path}; survives restarts"
            persistent.append(i)
        else:
            scope = "every server that reaches it; survives restarts (Redis: if it persists)"
            persistent.append(i)
        report.add(f"tier{i} sharing", INFO, f"{t.redacted()}: {scope}")
    if not persistent:
        report.add(
            "persistence",
            WARN,
            "every tier is process memory: nothing is reused after a restart or by another server",
            "add a file://, redis:// or s3:// tier below the memory tier",
        )
    _budgets(report, cfg, facts, store)


def _budgets(report: Report, cfg: Any, facts: dict[str, Any], store: Any) -> None:
    from kvstore.backends import backend_class

    caps: list[int | None] = []
    for i, t in enumerate(cfg.tiers):
        cap = t.options.capacity
        caps.append(cap)
        scheme = urlsplit(t.url).scheme
        label = f"tier{i} budget"
        if not cap:
            if scheme in ("mem", "file"):
                what = "memory" if scheme == "mem" else "disk"
                report.add(
                    label,
                    WARN,
                    f"{t.redacted()} has no capacity: it grows until the {what} is full",
                    "add ?capacity=… to the URL (e.g. 8GiB for memory, 500GiB for disk)",
                )
            else:
                report.add(label, INFO, f"{t.redacted()}: no capacity; the server's own limits apply")
            continue
        detail = f"{t.redacted()}: {_human(cap)}"
        status = OK
        fix = ""
        if not backend_class(t.url).capabilities.enforces_capacity:  # redis://, s3://
            detail += (
                " placed by this process (the backend enforces no budget: several processes may"
                " together place more; the server's own limits bound the medium)"
            )
        if scheme == "file":
            path = Path(unquote(urlsplit(t.url).path))
            try:
                du = shutil.disk_usage(path)
                held = 0
                if store is not None:
                    held = store.tiers[i].backend.stats().bytes or 0
                room = du.free + held
                detail += f"; the file system has {_human(du.free)} free"
                if cap > room:
                    status = WARN
                    fix = f"lower ?capacity= to at most {_human(room)} or free space on {path}"
            except OSError:
                pass
        elif scheme == "mem":
            try:
                ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                detail += f" of {_human(ram)} RAM"
                if cap > 0.8 * ram:
                    status, fix = (
                        WARN,
                        "keep memory tiers well below the host's RAM (LMCache and vLLM need it too)",
                    )
            except (ValueError, OSError):
                pass
        report.add(label, status, detail, fix)
    for i in range(1, len(caps)):
        above, here = caps[i - 1], caps[i]
        if above and here and here < above:
            report.add(
                f"tier{i} budget",
                WARN,
                f"tier{i} ({_human(here)}) is smaller than tier{i - 1} above it ({_human(above)}): "
                "chunks demoted into it are evicted before the tier above would have dropped them",
                f"give tier{i} at least the capacity of tier{i - 1}, or drop one of them",
            )
    pending = cfg.max_pending
    report.add(
        "max_pending",
        INFO,
        f"{_human(pending) if pending else 'unbounded'} of writes in flight; beyond it a store is dropped "
        "and counted (kvstore_plugin_put_dropped_budget_total), never waited for",
    )
    blocking = facts.get("blocking_timeout_secs")
    limit = f" (LMCache blocking_timeout_secs={blocking})" if blocking is not None else ""
    report.add("timeout_s", INFO, f"{cfg.timeout_s:g}s per read or lookup{limit}; a slower tier is a miss")


def check_metrics(report: Report, facts: dict[str, Any]) -> None:
    """Where the kvstore metrics will be scrapeable, and whether the port can be bound."""
    from kvstore.metrics_export import ENV_ADDR, ENV_PORT, parse_port

    if report.mode == "mp":
        where = (
            "in the default Prometheus registry, which `python -m lmcache.v1.multiprocess.server` serves on "
            "--prometheus-port (9090) when it has no --otlp-endpoint; `lmcache server` (LMCache 0.5.6) "
            "serves no /metrics"
        )
        fix = 'add "metrics_port": 9464 to adapter_params (or set KVSTORE_METRICS_PORT)'
    elif facts.get("internal_api_server_enabled"):
        start = int(facts.get("internal_api_server_port_start") or 6999)
        where = (
            "in the default Prometheus registry, served at /metrics by LMCache's internal API server "
            f"(port {start + 1} for worker 0, {start + 2} for worker 1, ...)"
        )
        fix = ""
    else:
        where = "in the default Prometheus registry, which nothing serves while LMCache's internal API server is off"
        fix = f"set {ENV_PORT}=9464, or LMCACHE_INTERNAL_API_SERVER_ENABLED=True"
    try:
        port = facts.get("metrics_port")
        if port is None:
            port = parse_port(os.environ.get(ENV_PORT))
    except ValueError as exc:
        report.add("metrics", FAIL, str(exc), f"set {ENV_PORT} to a free TCP port, or unset it")
        return
    if port is None:
        report.add("metrics", WARN if fix else INFO, f"kvstore's metrics are {where}; no metrics port", fix)
        return
    addr = os.environ.get(ENV_ADDR) or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, port))
    except OSError as exc:
        report.add(
            "metrics",
            WARN,
            f"metrics port {port} on {addr} cannot be bound now ({exc.strerror}); "
            "fine if the server is running and holds it",
            f"otherwise pick a free port for {ENV_PORT} / metrics_port",
        )
        return
    report.add("metrics", OK, f"served on http://{addr}:{port}/metrics, and {where}")


def check_checksum(report: Report) -> None:
    """Which CRC32C code verifies frames here (both give the same values)."""
    from kvstore import checksum

    if checksum.fast():
        kind = "AVX-512" if checksum.vector_bits() == 512 else "AVX2"
        report.add(
            "checksum",
            OK,
            f"CRC32C by the {checksum.vector_bits()}-bit {kind} VPCLMULQDQ kernels (copy and hash in one pass); "
            "file:// tiers copy warm objects from a mapping of the file, checksummed in the same pass "
            "(mmap=false: pread)",
        )
    elif os.environ.get(checksum.ENV_FALLBACK, "").lower() == "package":
        report.add("checksum", INFO, f"CRC32C by the crc32c package ({checksum.ENV_FALLBACK}=package is set)")
    else:
        report.add(
            "checksum",
            INFO,
            "CRC32C by the crc32c package: this CPU has no VPCLMULQDQ with AVX2 or AVX-512 (or the kernels "
            "could not be compiled; the log says why); verified reads cost more CPU here, and "
            "file:// tiers read with pread (the mapped read needs the kernels)",
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -------------------------------------------------------------------------------- run
def run_doctor(*, config_file: str | None, l2_adapter: str | None, timeout: float) -> Report:
    """Every check, in order; never raises for a configuration problem (it is reported)."""
    if l2_adapter is not None:
        report = Report("mp", "--l2-adapter")
    else:
        source = "environment (LMCACHE_*, LMCACHE_EXTRA_CONFIG, KVSTORE_*)"
        if config_file:
            source += f" with KVSTORE_CONFIG={config_file}"
        report = Report("in-process", source)
    try:
        if l2_adapter is not None:
            cfg, facts = mp_config(report, l2_adapter)
        else:
            with _env("KVSTORE_CONFIG", config_file):
                cfg, facts = in_process_config(report)
    except ConfigInvalid:
        report.exit_code = EXIT_CONFIG
        return report
    report.config = cfg.describe()
    report.add("kvstore settings", OK, _describe(cfg, facts))

    async def tiers() -> None:
        with _quiet("kvstore"):
            store = await check_tiers(report, cfg, timeout)
        try:
            check_reuse(report, cfg, facts, store)
        finally:
            if store is not None:
                await store.close()

    asyncio.run(tiers())
    check_metrics(report, facts)
    check_checksum(report)
    report.exit_code = EXIT_FAILED if report.failed else 0
    return report


def _describe(cfg: Any, facts: dict[str, Any]) -> str:
    tiers = ", ".join(t.redacted() + (f" [{t.codec}]" if t.codec != "raw" else "") for t in cfg.tiers)
    who = facts.get("plugin") or "kvstore"
    return (
        f"{who}: tiers {tiers}; namespace {cfg.namespace}; policy {cfg.policy}; timeout_s {cfg.timeout_s:g}"
    )


def _print(report: Report) -> None:
    click.echo(f"kvstore doctor: {report.mode} mode, configuration from {report.source}")
    for c in report.checks:
        click.echo(f"  {c.status:<5} {c.name}: {c.detail}")
        if c.fix:
            click.echo(f"        fix: {c.fix}")
    failed = report.failed
    warns = sum(c.status == WARN for c in report.checks)
    if failed:
        click.echo(f"FAILED: {', '.join(c.name for c in failed)}")
    else:
        click.echo(f"OK ({warns} warning{'s' if warns != 1 else ''})")


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="A kvstore config file (JSON/TOML), read as KVSTORE_CONFIG would be.",
)
@click.option(
    "--l2-adapter",
    "l2_adapter",
    metavar="JSON",
    help="Check MP mode: the --l2-adapter JSON exactly as given to `lmcache server` (or a file holding it).",
)
@click.option(
    "--timeout", default=15.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds per tier."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def doctor(config_file: str | None, l2_adapter: str | None, timeout: float, as_json: bool) -> None:
    """Check the kvstore configuration the plugins (or the MP adapter) would load.

    Validates it with the plugins' own code, reaches every tier, round-trips one probe
    chunk per tier (write, verified read, delete), and says what reuse across restarts
    and servers needs.  Exit 0 when everything works; 1 when a check fails; 2 when the
    configuration is invalid.
    """
    if config_file and l2_adapter:
        raise click.UsageError(
            "--config is for the in-process plugins; put config_file in adapter_params instead"
        )
    report = run_doctor(config_file=config_file, l2_adapter=l2_adapter, timeout=timeout)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        _print(report)
    sys.exit(report.exit_code)
