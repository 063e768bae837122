"""How a TieredStore's tiers are described: `TierSpec`, and tier URLs with store options.

Owns: `TierSpec`, the store options a tier URL may carry (``capacity``, ``policy``,
``write``, ``high``, ``low``; `split_store_options` takes them out before the backend
sees the URL) and turning specs into the engine's `Placement`.  Must not touch: I/O
beyond opening each tier's backend.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.options import parse_size
from kvstore.policy import DEFAULT_POLICY, Placement, TierState, WriteMode, make_policy
from kvstore.tier import Tier

UNBOUNDED = sys.maxsize
STORE_OPTIONS = frozenset({"capacity", "policy", "write", "high", "low"})


@dataclass
class TierSpec:
    """One tier of a store: where (`tier`), how much (`capacity` bytes, None = unbounded),
    which policy, write mode ("back": filled by demotion; "through": every store lands
    here too) and watermarks (evict from above `high` × capacity down to `low` ×)."""

    tier: Tier
    capacity: int | None = None
    policy: str = DEFAULT_POLICY
    write: WriteMode = "back"
    high: float = 1.0
    low: float = 1.0
    name: str = ""


def split_store_options(url: str) -> tuple[str, dict[str, str]]:
    """(`url` without the store's own query options, those options)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    mine = {k: v for k, v in query if k in STORE_OPTIONS}
    rest = [(k, v) for k, v in query if k not in STORE_OPTIONS]
    return urlunsplit(parts._replace(query=urlencode(rest))), mine


def spec_from_url(url: str, codec: str, policy: str, name: str) -> TierSpec:
    """A `TierSpec` for a tier URL (store options in its query), its backend opened."""
    backend_url, opts = split_store_options(url)
    mode = opts.get("write", "back")
    write: WriteMode
    if mode == "back":
        write = "back"
    elif mode == "through":
        write = "through"
    else:
        raise ValueError(f"write={mode!r} in {url!r}: use write=back or write=through")
    return TierSpec(
        tier=Tier.open(backend_url, codec),
        capacity=parse_size(opts.get("capacity")),
        policy=opts.get("policy", policy),
        write=write,
        high=float(opts.get("high", 1.0)),
        low=float(opts.get("low", 1.0)),
        name=name,
    )


def specs_from(specs: Sequence[str | tuple[str, str] | TierSpec], policy: str) -> list[TierSpec]:
    """`TierSpec`s from URLs, ``(url, codec)`` pairs or specs, hot first."""
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TierSpec):
            out.append(spec)
            continue
        url, codec = (spec, "raw") if isinstance(spec, str) else spec
        out.append(spec_from_url(url, codec, policy, f"tier{i}"))
    return out


def placement_for(specs: Sequence[TierSpec], promote: bool) -> Placement:
    """The engine's `Placement` over `specs` (capacity None: unbounded)."""
    states = []
    for i, s in enumerate(specs):
        cap = s.capacity if s.capacity else UNBOUNDED
        states.append(
            TierState(
                capacity=cap,
                policy=make_policy(s.policy, cap),
                name=s.name or f"tier{i}",
                write=s.write,
                high=s.high,
                low=s.low,
            )
        )
    if any(st.policy.offline for st in states):
        raise ValueError("belady needs the future; it runs only in `kvstore simulate`")
    return Placement(states, promote=promote)
