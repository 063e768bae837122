"""Codec registry: ``kvstore.codec.get(name, **options)``.

`raw` (zero-copy) is built in; `cachegen` (lossy, for cold tiers) is loaded lazily.
New codecs register with `register`.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl

from kvstore.codec.base import Codec, Encoded

__all__ = ["Codec", "Encoded", "get", "names", "parse_spec", "register"]

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


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"cachegen?profile=smollm2-135m&threads=2"`` → ("cachegen", {"profile": ..., "threads": 2}).

    The spelling every configuration surface accepts (tier configs, ``--recode``, demo
    options); integer-looking values become ints.
    """
    name, _, query = spec.partition("?")
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, options


def get(name: str, **options: Any) -> Codec:
    """A codec by name or spec: ``get("raw")``, ``get("cachegen", preset="lmcache")``,
    ``get("cachegen?profile=smollm2-135m")``."""
    if "?" in name:
        name, parsed = parse_spec(name)
        options = {**parsed, **options}
    cls = _REGISTERED.get(name)
    if cls is None:
        target = _BUILTIN.get(name)
        if target is None:
            raise ValueError(f"unknown codec {name!r}; known: {', '.join(names())}")
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    return cls(**options)
