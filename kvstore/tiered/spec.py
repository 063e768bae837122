"""How a TieredStore's tiers are described: `TierSpec`, and the engine's `Placement` from specs.

Owns: `TierSpec` (one tier of a store: the opened `Tier` and what the store does with
it) and turning specs into the engine's `Placement`.  A tier URL's store options are
read once by `kvstore.tier_options.TierOptions`; this module only resolves what the URL
leaves to the store (policy, write mode).  Must not touch: I/O beyond opening each
tier's backend, URL parsing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.policy import DEFAULT_POLICY, Placement, TierState, WriteMode, make_policy
from kvstore.tier import Tier
from kvstore.tier_options import TierOptions

UNBOUNDED = sys.maxsize


@dataclass
class TierSpec:
    """One tier of a store: where (`tier`), how much (`capacity`: bytes of the tier's
    medium, None = unbounded; the store's placement budget, and the backend's own hard
    bound where it enforces one), which policy, write mode ("back": filled by demotion;
    "through": every store lands here too) and watermarks (evict from above `high` ×
    capacity down to `low` ×)."""

    tier: Tier
    capacity: int | None = None
    policy: str = DEFAULT_POLICY
    write: WriteMode = "back"
    high: float = 1.0
    low: float = 1.0
    name: str = ""

    @classmethod
    def open(
        cls,
        url: str,
        codec: str = "raw",
        *,
        policy: str = DEFAULT_POLICY,
        write: WriteMode = "back",
        name: str = "",
    ) -> TierSpec:
        """A spec for a tier URL, its backend opened; `policy` and `write` apply where the
        URL names none."""
        backend_url, opts = TierOptions.parse(url)
        return cls.from_options(Tier.open(backend_url, codec), opts, policy=policy, write=write, name=name)

    @classmethod
    def from_options(
        cls,
        tier: Tier,
        opts: TierOptions,
        *,
        policy: str = DEFAULT_POLICY,
        write: WriteMode = "back",
        name: str = "",
    ) -> TierSpec:
        """A spec for an opened `tier` and its URL's options (see `open`)."""
        return cls(
            tier=tier,
            capacity=opts.capacity,
            policy=opts.policy or policy,
            write=opts.write or write,
            high=opts.high,
            low=opts.low,
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
        out.append(TierSpec.open(url, codec, policy=policy, name=f"tier{i}"))
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
