"""Small configuration helpers: sizes, booleans, URL query options, `KVSTORE_HOME`,
and `redact_url` / `redact_text`, the one redaction of secrets in URLs.

Owns: parsing of human-written settings, and what of them may be shown.  Must not
touch: backends or I/O beyond creating the home directory.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

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


# ---------------------------------------------------------------- redaction
REDACTED = "***"
# query keys whose value is a secret, matched as a part of the key, case-insensitively:
# secret_key, aws_secret_access_key, aws_session_token, password, api_key, X-Amz-Signature ...
SECRET_KEY_PARTS = ("password", "passwd", "pwd", "secret", "token", "key", "credential", "signature", "auth")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_SECRET_PAIR = re.compile(
    r"(?i)(?<![A-Za-z0-9])([A-Za-z0-9_.-]*(?:" + "|".join(SECRET_KEY_PARTS) + r")[A-Za-z0-9_.-]*)"
    r"(\s*[=:]\s*)(['\"]?)([^\s&'\",;)]+)"
)


def is_secret_key(key: str) -> bool:
    """Whether a URL query key (or config key) holds a secret."""
    k = unquote(key).lower()
    return any(part in k for part in SECRET_KEY_PARTS)


def redact_url(url: str) -> str:
    """`url` fit to show: userinfo and the values of secret-bearing query keys become ``***``.

    ``user:pass@`` keeps the user (``user:***@``); a lone ``TOKEN@`` (a token or an
    access key given as the user) becomes ``***@``.  Everything else is kept as written.
    Never raises: a URL too malformed to parse is redacted by pattern instead.
    """
    if "://" not in url:  # "user:pass@host?..." without a scheme: all before the @ is userinfo
        head, q, query = url.partition("?")
        if "@" in head and "/" not in head.rsplit("@", 1)[0]:
            head = f"{REDACTED}@{head.rsplit('@', 1)[1]}"
        return head + q + "&".join(_redact_pair(p) for p in query.split("&")) if q else head
    try:
        parts = urlsplit(url)
    except ValueError:
        return _redact_pattern(url)
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user, colon, _ = creds.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"
    query = "&".join(_redact_pair(p) for p in parts.query.split("&")) if parts.query else ""
    fragment = _redact_pattern(parts.fragment) if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _redact_pair(pair: str) -> str:
    key, eq, _value = pair.partition("=")
    return f"{key}={REDACTED}" if eq and is_secret_key(key) else pair


def _redact_pattern(text: str) -> str:
    text = re.sub(r"(://)[^/@\s]*@", rf"\g<1>{REDACTED}@", text)
    return _SECRET_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{REDACTED}", text)


def redact_text(text: str) -> str:
    """A message fit to show: every URL in it through `redact_url`, and any other
    ``secret_key=value`` / ``password: value`` pair with its value replaced."""
    out = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _SECRET_PAIR.sub(
        lambda m: m.group(0) if m.group(4) == REDACTED else f"{m.group(1)}{m.group(2)}{m.group(3)}{REDACTED}",
        out,
    )


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
