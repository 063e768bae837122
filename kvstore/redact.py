"""The one redaction of secrets: `redact_url` and `redact_text`, used wherever a URL or
a message that may hold one is shown (errors, logs, stats, reports, the CLI).

Owns: which keys hold secrets and how they are hidden.  Must not touch: anything else;
it imports only the standard library.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

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
