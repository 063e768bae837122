"""Reading human-written settings: sizes, durations, booleans, bounded numbers, URL
query options, and where `KVSTORE_HOME` is.

Owns: turning a setting's text into a value, with errors that name the setting and say
what to write.  Must not touch: backends, or I/O beyond creating the home directory.
Showing a setting (secrets hidden) is `kvstore.redact`'s job.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from kvstore.redact import redact_url

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
_SIGNED_SIZE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


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


def option_int(name: str, text: str | int, *, minimum: int = 1) -> int:
    """An integer setting of at least `minimum`; the error names the setting."""
    try:
        value = text if isinstance(text, int) and not isinstance(text, bool) else int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer; write e.g. {name}={max(minimum, 4)}") from None
    if value < minimum:
        raise ValueError(f"{name}={text!r} must be at least {minimum}")
    return value


def option_bool(name: str, text: str | bool | None, default: bool) -> bool:
    """A true/false setting (`default` when absent); the error names the setting."""
    try:
        return parse_bool(text, default)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a boolean; write {name}=true or {name}=false") from None


def option_float(name: str, text: str | float, *, allow_zero: bool = False) -> float:
    """A positive (with `allow_zero`: non-negative) finite number; the error names the setting."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={text!r} is not a number; write e.g. {name}=5 or {name}=0.5") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={text!r} must be {'zero or more' if allow_zero else 'more than zero'}")
    return value


def option_size(name: str, text: str | int | None, *, unbounded: bool = True) -> int | None:
    """A byte size setting: ``512MiB``, ``10GiB``, an integer.  With `unbounded`, ``none``
    (or ``unbounded``, ``inf``, empty) means no limit (None); zero and negative sizes are
    errors naming the setting, never a silent "unlimited"."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r}: cannot read size; write e.g. {name}=512MiB")
    word = text.strip().lower() if isinstance(text, str) else None
    if word in ("", "none", "inf", "unbounded"):
        if unbounded:
            return None
        raise ValueError(f"{name} needs a size; write e.g. {name}=512MiB")
    if isinstance(text, int):
        value = text
    else:
        m = _SIGNED_SIZE.match(text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={text!r}: cannot read size; write e.g. {name}=512MiB, 10GiB or 1000000")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        hint = f" (for no limit write {name}=none)" if unbounded else ""
        raise ValueError(f"{name}={text!r} must be more than zero{hint}")
    return value


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
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} in {redact_url(url)!r}; known: {sorted(allowed)}"
        )
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
