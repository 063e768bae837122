"""kvstore's own settings, from LMCache's ``extra_config``, ``KVSTORE_*`` or a file.

Owns: the `StoreConfig` / `TierConfig` values, reading them from the three sources,
strict validation with errors that say what to write instead, and `build()` which
opens the store they describe.  Must not touch: LMCache objects (the plugins hand
this module a plain mapping), I/O beyond opening the store and reading the file.

Sources, lowest precedence first (later ones override single keys):

1. a config file (JSON, or TOML on Python >= 3.11) named by ``kvstore.config_file``
   or ``KVSTORE_CONFIG``; keys written without the ``kvstore.`` prefix;
2. the environment: ``KVSTORE_TIERS``, ``KVSTORE_COLD_CODEC``, ``KVSTORE_NAMESPACE``,
   ``KVSTORE_TIMEOUT_S``, ``KVSTORE_MAX_PENDING``, ``KVSTORE_POLICY``;
3. LMCache's ``extra_config`` keys ``kvstore.tiers``, ``kvstore.cold_codec``, … .

``tiers`` is hottest first: a list of URLs (or ``{"url": ..., "codec": ...}`` maps), or
one string of URLs separated by ``,`` / whitespace.  Byte budgets live in each URL
(``mem://hot?capacity=2GiB``, ``file:///var/kv?capacity=50GiB``: the bytes of the tier's
medium, see `kvstore.tier_options`); each URL's store options are read once, into
`TierConfig.options`.  ``cold_codec`` sets the codec of the last tier when there are two
or more (e.g. ``cachegen``).

`build()` opens a `kvstore.tiered.TieredStore`: ``policy`` names its placement policy
(``chain`` by default; ``lru``, ``lfu``, ``arc``, ``wtinylfu``), and the store finds
objects other processes stored in shared tiers.  Every tier below the first is written
through unless its URL says ``write=back`` (then it fills only by demotion), so a chunk
reaches the shared, persistent tiers when it is stored, not only when memory evicts it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.options import kvstore_home, option_float, option_size
from kvstore.policy import DEFAULT_POLICY, ONLINE_POLICIES
from kvstore.redact import redact_url
from kvstore.tier_options import TierOptions, WriteMode

PREFIX = "kvstore."
ENV_PREFIX = "KVSTORE_"
KEYS = ("tiers", "cold_codec", "namespace", "timeout_s", "max_pending", "policy", "config_file")
POLICIES = ONLINE_POLICIES
_ENV_FOR = {
    "tiers": "KVSTORE_TIERS",
    "cold_codec": "KVSTORE_COLD_CODEC",
    "namespace": "KVSTORE_NAMESPACE",
    "timeout_s": "KVSTORE_TIMEOUT_S",
    "max_pending": "KVSTORE_MAX_PENDING",
    "policy": "KVSTORE_POLICY",
    "config_file": "KVSTORE_CONFIG",
}


class StoreConfigError(ValueError):
    """A setting kvstore cannot use; the message names the setting and the fix."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier as configured: its URL as written, its codec, and (read from the URL
    once, here) the URL its backend is opened with and the store options."""

    url: str
    codec: str = "raw"
    backend_url: str = field(init=False, repr=False, compare=False)
    options: TierOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        backend_url, options = TierOptions.parse(self.url)
        object.__setattr__(self, "backend_url", backend_url)
        object.__setattr__(self, "options", options)

    def redacted(self) -> str:
        return redact_url(self.url)


def default_tiers(home: Path | None = None) -> tuple[TierConfig, ...]:
    """The embedded default: process memory, then local disk under ``$KVSTORE_HOME``."""
    import importlib.util

    hot = TierConfig("mem://kvstore-hot?capacity=1GiB")
    if importlib.util.find_spec("kvstore.backends.disk") is None:  # disk tier not built in
        return (hot,)
    home = home or kvstore_home()
    return (hot, TierConfig(f"file://{home / 'warm'}?capacity=10GiB&fsync=false"))


@dataclass(frozen=True, slots=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...] = field(default_factory=default_tiers)
    namespace: str = "default"
    timeout_s: float = 5.0
    max_pending: int | None = 1 << 30
    policy: str = DEFAULT_POLICY

    # ---------------------------------------------------------------- sources
    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None, *, prefix: str = PREFIX) -> StoreConfig:
        """From ``extra_config``-style keys (``kvstore.tiers`` …); other keys are ignored.

        A ``kvstore.config_file`` key (or ``KVSTORE_CONFIG``) is read first, then the
        ``KVSTORE_*`` environment, then these keys on top.
        """
        ours = _ours(mapping or {}, prefix, source="extra_config")
        env = _env_values()
        path = ours.get("config_file") or env.get("config_file")
        values: dict[str, Any] = _file_values(Path(str(path))) if path else {}
        values.update({k: v for k, v in env.items() if k != "config_file"})
        values.update({k: v for k, v in ours.items() if k != "config_file"})
        return cls._from_values(values)

    @classmethod
    def from_env(cls) -> StoreConfig:
        return cls.from_mapping({})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StoreConfig:
        return cls._from_values(_file_values(Path(path)))

    @classmethod
    def _from_values(cls, values: Mapping[str, Any]) -> StoreConfig:
        cfg = cls()
        if "tiers" in values:
            cfg = replace(cfg, tiers=_parse_tiers(values["tiers"]))
        if "cold_codec" in values and values["cold_codec"] not in (None, ""):
            if len(cfg.tiers) < 2:
                raise StoreConfigError(
                    "kvstore.cold_codec needs at least two tiers (it sets the last one's codec); "
                    "add a cold tier to kvstore.tiers or drop kvstore.cold_codec"
                )
            last = replace(cfg.tiers[-1], codec=str(values["cold_codec"]))
            cfg = replace(cfg, tiers=(*cfg.tiers[:-1], last))
        if "namespace" in values:
            cfg = replace(cfg, namespace=str(values["namespace"]))
        if "timeout_s" in values:
            cfg = replace(cfg, timeout_s=_parse_float("timeout_s", values["timeout_s"]))
        if "max_pending" in values:
            try:
                cfg = replace(cfg, max_pending=option_size("max_pending", values["max_pending"]))
            except ValueError as exc:
                raise StoreConfigError(f"kvstore.max_pending: {exc}") from None
        if "policy" in values:
            cfg = replace(cfg, policy=str(values["policy"]))
        cfg.validate()
        return cfg

    # ------------------------------------------------------------- validation
    def validate(self, *, blocking_timeout_s: float | None = None) -> None:
        """Raise `StoreConfigError` naming the first unusable setting and its fix."""
        from kvstore import codec as codecs
        from kvstore.backends import backend_class

        if not self.tiers:
            raise StoreConfigError("kvstore.tiers is empty; give at least one URL, e.g. mem://hot")
        for i, tier in enumerate(self.tiers):
            try:
                backend_class(tier.url)
            except ValueError as exc:
                raise StoreConfigError(f"kvstore.tiers[{i}] ({tier.redacted()}): {exc}") from None
            try:
                codecs.get(tier.codec)  # a name or a spec such as cachegen?profile=smollm2-135m
            except (ValueError, TypeError, OSError) as exc:
                raise StoreConfigError(
                    f"kvstore.tiers[{i}] codec {tier.codec!r}: {exc}; known codecs: {', '.join(codecs.names())}"
                ) from None
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.namespace):
            raise StoreConfigError(
                f"kvstore.namespace {self.namespace!r}: use 1-64 letters, digits, '_', '-' or '.'"
            )
        if not self.timeout_s > 0:
            raise StoreConfigError("kvstore.timeout_s must be > 0 seconds")
        if blocking_timeout_s is not None and self.timeout_s >= blocking_timeout_s:
            raise StoreConfigError(
                f"kvstore.timeout_s={self.timeout_s} must be below LMCache's "
                f"blocking_timeout_secs={blocking_timeout_s}, so a slow tier becomes a miss "
                "before LMCache gives up; lower kvstore.timeout_s"
            )
        if self.policy == "write-through":
            raise StoreConfigError(
                "kvstore.policy 'write-through' is gone: lower tiers are written through by default "
                f"(write=back in a tier URL turns it off); set kvstore.policy to one of {', '.join(POLICIES)}"
            )
        if self.policy not in POLICIES:
            raise StoreConfigError(f"kvstore.policy {self.policy!r} is unknown; known: {', '.join(POLICIES)}")

    # ------------------------------------------------------------------ build
    def build(self):
        """Open the store this config describes (call inside the event loop that will use it)."""
        from kvstore.tier import Tier
        from kvstore.tiered import TieredStore, TierSpec

        specs = [
            TierSpec.from_options(
                Tier.open(t.backend_url, t.codec),
                t.options,
                policy=self.policy,
                write=self.write_mode(i),
                name=f"tier{i}",
            )
            for i, t in enumerate(self.tiers)
        ]
        # each tier answers within half the deadline (a read may try two tiers in turn);
        # a tier that misses it fails fast until it answers again, the others go on
        return TieredStore(specs, discover=True, tier_timeout=self.timeout_s / 2)

    def store_deadline_s(self) -> float:
        """The longest one store call may take, end to end: twice the tiers' write deadline
        (`kvstore.tiered.guard.write_deadline`), which leaves room for framing, waiting
        for room and a write into each tier, so a tier too slow to write is timed out by
        its own deadline (its breaker opens: later stores do not wait on it) before the
        caller gives up on the call."""
        from kvstore.tiered.guard import write_deadline

        inner = write_deadline(self.timeout_s / 2)
        assert inner is not None
        return 2 * inner

    def write_mode(self, i: int) -> WriteMode:
        """Tier `i`'s write mode: its URL's ``write=``, else "through" below the first tier
        (a chunk reaches the shared, persistent tiers when it is stored)."""
        return self.tiers[i].options.write or ("through" if i else "back")

    def describe(self) -> dict[str, Any]:
        return {
            "tiers": [{"url": t.redacted(), "codec": t.codec} for t in self.tiers],
            "namespace": self.namespace,
            "timeout_s": self.timeout_s,
            "max_pending": self.max_pending,
            "policy": self.policy,
        }


# ------------------------------------------------------------------ helpers
def _ours(mapping: Mapping[str, Any], prefix: str, *, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name not in KEYS:
            raise StoreConfigError(
                f"{source} key {key!r} is unknown; known: {', '.join(prefix + k for k in KEYS)}"
            )
        out[name] = value
    return out


def _env_values() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, env in _ENV_FOR.items():
        if env in os.environ:
            out[key] = os.environ[env]
    return out


def _file_values(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise StoreConfigError(f"cannot read kvstore config file {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise StoreConfigError(
            f"kvstore config file {path} is not valid {path.suffix or 'JSON'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise StoreConfigError(f"kvstore config file {path} must hold a table/object of settings")
    if isinstance(data.get("kvstore"), dict):  # allow a [kvstore] section
        data = data["kvstore"]
    data = {k.removeprefix(PREFIX): v for k, v in data.items()}
    unknown = sorted(set(data) - set(KEYS) - {"config_file"})
    if unknown:
        raise StoreConfigError(
            f"kvstore config file {path}: unknown key(s) {unknown}; known: {', '.join(KEYS)}"
        )
    return data


def _parse_tiers(value: Any) -> tuple[TierConfig, ...]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise StoreConfigError(f"kvstore.tiers is not valid JSON: {exc}") from None
        else:
            value = [u for u in re.split(r"[,\s]+", text) if u]
    if not isinstance(value, (list, tuple)):
        raise StoreConfigError("kvstore.tiers must be a list of URLs (hottest first)")
    tiers = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            url, codec = item, "raw"
        elif isinstance(item, Mapping) and "url" in item and set(item) <= {"url", "codec"}:
            url, codec = str(item["url"]), str(item.get("codec", "raw"))
        else:
            raise StoreConfigError(
                f"kvstore.tiers[{i}] must be a URL string or {{'url': ..., 'codec': ...}}, got {item!r}"
            )
        try:
            tiers.append(TierConfig(url, codec))
        except ValueError as exc:
            raise StoreConfigError(f"kvstore.tiers[{i}] ({redact_url(url)}): {exc}") from None
    return tuple(tiers)


def _parse_float(name: str, value: Any) -> float:
    try:
        return option_float(name, value)
    except ValueError as exc:
        raise StoreConfigError(
            f"kvstore.{name}: cannot read {value!r} as a number of seconds ({exc})"
        ) from None
