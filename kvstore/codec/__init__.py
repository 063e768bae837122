"""Codec registry: ``kvstore.codec.get(name, **options)``.

`raw` (zero-copy) is built in; `cachegen` (lossy, for cold tiers) is loaded lazily.
New codecs register with `register`.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.codec.base import Codec, Encoded

__all__ = ["Codec", "Encoded", "get", "names", "register"]

_BUILTIN = {
    "raw": "kvstore.codec.raw:RawCodec",
    "cachegen": "kvstore.codec.cachegen:CacheGenCodec",
}
_REGISTERED: dict[str, type[Codec]] = {}


def register(name: str):
    def deco(cls: type[Codec]) -> type[Codec]:
        _REGISTERED[name] = cls
        return cls

    return deco


def names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def get(name: str, **options: Any) -> Codec:
    """A codec instance by name, e.g. ``get("raw")`` or ``get("cachegen", preset="lmcache")``."""
    cls = _REGISTERED.get(name)
    if cls is None:
        target = _BUILTIN.get(name)
        if target is None:
            raise ValueError(f"unknown codec {name!r}; known: {', '.join(names())}")
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    return cls(**options)
