"""Backend registry: open any backend from its URL.

Owns: the scheme → backend class table.  Built-in backends are imported lazily, so a
missing optional dependency (redis, aioboto3) only matters when its scheme is used.
A new backend registers with `register` (or by adding a line to `_BUILTIN`).
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from kvstore.backends.base import Alloc, Backend, BackendStats, ObjectInfo, Value
from kvstore.redact import redact_url

__all__ = ["Alloc", "Backend", "BackendStats", "ObjectInfo", "Value", "open_backend", "register"]

_BUILTIN: dict[str, str] = {
    "mem": "kvstore.backends.memory:MemoryBackend",
    "file": "kvstore.backends.disk:DiskBackend",
    "redis": "kvstore.backends.redis:RedisBackend",
    "rediss": "kvstore.backends.redis:RedisBackend",
    "unix": "kvstore.backends.redis:RedisBackend",
    "redis+cluster": "kvstore.backends.redis:RedisBackend",
    "rediss+cluster": "kvstore.backends.redis:RedisBackend",
    "s3": "kvstore.backends.s3:S3Backend",
}
_REGISTERED: dict[str, type[Backend]] = {}


def register(*schemes: str):
    """Class decorator: make `cls` the backend for these URL schemes."""

    def deco(cls: type[Backend]) -> type[Backend]:
        for s in schemes:
            _REGISTERED[s] = cls
        return cls

    return deco


def backend_class(url: str) -> type[Backend]:
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise ValueError(
            f"{redact_url(url)!r} has no scheme; use mem://NAME, file:///PATH, redis://HOST:PORT or s3://BUCKET/PREFIX"
        )
    if scheme in _REGISTERED:
        return _REGISTERED[scheme]
    target = _BUILTIN.get(scheme)
    if target is None:
        known = ", ".join(sorted({*_BUILTIN, *_REGISTERED}))
        raise ValueError(f"unknown backend scheme {scheme!r} in {redact_url(url)!r}; known: {known}")
    module, _, name = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        extra = {"redis": "redis", "s3": "s3"}.get(module.rsplit(".", 1)[-1], "all")
        raise ValueError(
            f"backend for {scheme}:// needs an optional dependency ({exc.name}); "
            f"install it with: pip install 'kvstore[{extra}]'"
        ) from exc
    return getattr(mod, name)


def open_backend(url: str, *, create: bool = True) -> Backend:
    """Open a backend from a URL such as ``file:///var/cache/kv?capacity=10GiB``.

    With ``create=False`` the store must exist already (`Backend.open_existing`): read-only
    tools use it so that a mistyped path is an error, not a new empty store.
    """
    cls = backend_class(url)
    return cls.from_url(url) if create else cls.open_existing(url)
