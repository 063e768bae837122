"""Small configuration helpers: sizes, booleans, URL query options, `KVSTORE_HOME`.

Owns: parsing of human-written settings.  Must not touch: backends or I/O beyond
creating the home directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | None) -> int | None:
    """``"10GiB"`` → 10737418240; ints pass through; None/""/"0"/"none" → None (unbounded)."""
    if text is None or isinstance(text, int):
        return text or None
    if text.strip().lower() in ("", "none", "inf", "unbounded", "0"):
        return None
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write e.g. 512MiB, 10GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str | bool | None, default: bool = False) -> bool:
    if text is None:
        return default
    if isinstance(text, bool):
        return text
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"cannot read boolean {text!r}; write true or false")


def url_options(url: str, allowed: set[str]) -> dict[str, str]:
    """The query options of `url`; an unknown option is an error naming the known ones."""
    opts = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    unknown = set(opts) - allowed
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} in {url!r}; known: {sorted(allowed)}")
    return opts


def kvstore_home() -> Path:
    """Where the embedded default keeps its data: ``$KVSTORE_HOME`` or a per-user cache dir."""
    env = os.environ.get("KVSTORE_HOME")
    if env:
        home = Path(env).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = Path(base) / "kvstore"
    home.mkdir(parents=True, exist_ok=True)
    return home


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"7d"`` → 604800.0; units s, m, h, d, w (seconds when omitted)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"cannot read duration {text!r}; write e.g. 90s, 30m, 12h or 7d")
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]
