"""What a tier URL says to the store, read once: `TierOptions`.

Owns: the store options a tier URL may carry beside its backend's own (``capacity``,
``policy``, ``write``, ``high``, ``low``), their validation, and the URL the backend is
opened with.  Every reader of a tier URL (`kvstore.store_config`, `kvstore.tiered`,
the L2 adapter, ``kvstore doctor``) asks this module; none splits URLs itself.  Must not
touch: backends (beyond asking a backend class what it declares), I/O.

``capacity`` is the byte budget of the tier's medium, wherever the URL is used:

* a backend that declares ``Capabilities.enforces_capacity`` (``mem://``, ``file://``)
  keeps it in its URL and enforces it itself, evicting least recently used objects:
  per process for ``mem://``, for every process sharing the directory for ``file://``
  (its shared index).  That is the hard bound, and it covers bytes other processes add;
* a `kvstore.tiered.TieredStore` also takes the same number as its placement budget for
  the tier, and acts first: it demotes to the tier below (or drops, in the last tier)
  before the backend would have to evict, so data is kept where it can be;
* a backend that enforces no budget (``redis://``, ``s3://``) is opened without it; there
  the number bounds only what this process places in the tier, and the server's own
  limits (Redis ``maxmemory``, an S3 lifecycle rule) bound the medium.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.options import option_float, option_size
from kvstore.redact import redact_url

WriteMode = Literal["back", "through"]
STORE_OPTIONS = frozenset({"capacity", "policy", "write", "high", "low"})


@dataclass(frozen=True, slots=True)
class TierOptions:
    """The store options of one tier URL; None where the URL leaves it to the store.

    capacity: bytes of the tier's medium (None: unbounded).
    policy:   the tier's placement policy (None: the store's).
    write:    "back" (filled by demotion) or "through" (every store lands here too);
              None: the store's default for the tier's position.
    high/low: watermarks: a write that would take the tier above `high` × capacity
              evicts down to `low` × capacity.
    """

    capacity: int | None = None
    policy: str | None = None
    write: WriteMode | None = None
    high: float = 1.0
    low: float = 1.0

    @classmethod
    def parse(cls, url: str) -> tuple[str, TierOptions]:
        """(the URL to open the backend with, the store options of `url`).

        ``capacity`` stays in the backend's URL when the backend enforces it; the other
        store options never reach the backend.  Raises ValueError naming the option.
        """
        from kvstore.backends import backend_class
        from kvstore.policy import POLICIES

        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        mine = {k: v for k, v in query if k in STORE_OPTIONS}
        where = redact_url(url)
        try:
            capacity = option_size("capacity", mine.get("capacity"))
            high = option_float("high", mine.get("high", 1.0))
            low = option_float("low", mine.get("low", 1.0))
        except ValueError as exc:
            raise ValueError(f"{exc} in {where!r}") from None
        if not 0 < low <= high <= 1.0:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1 (got low={low}, high={high}) in {where!r}"
            )
        mode = mine.get("write")
        write: WriteMode | None
        if mode is None:
            write = None
        elif mode == "back":
            write = "back"
        elif mode == "through":
            write = "through"
        else:
            raise ValueError(f"write={mode!r} in {where!r}: use write=back or write=through")
        policy = mine.get("policy")
        if policy is not None and policy not in POLICIES:
            raise ValueError(
                f"policy={policy!r} in {where!r} is unknown; known: {', '.join(sorted(POLICIES))}"
            )
        enforced = capacity is not None and backend_class(url).capabilities.enforces_capacity
        keep = {"capacity"} if enforced else set()
        rest = [(k, v) for k, v in query if k not in STORE_OPTIONS or k in keep]
        backend_url = url if len(rest) == len(query) else urlunsplit(parts._replace(query=urlencode(rest)))
        return backend_url, cls(capacity, policy, write, high, low)
