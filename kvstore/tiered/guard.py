"""Per-tier deadlines and circuit breakers for a TieredStore's calls into its tiers.

Owns: `TierGuard`: every call the store makes to tier `j` runs through `call(j, ...)`
under that tier's deadline and breaker, and a tier that fails or is slow becomes the
caller's `default` for that tier only.  Must not touch: what the calls do (tiers, the
engine, in-flight state); it only times, counts and logs them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kvstore.backends.breaker import BreakerState, CircuitBreaker
from kvstore.deadlines import within
from kvstore.store_metrics import StoreMetrics
from kvstore.tier import Tier

log = logging.getLogger(__name__)
T = TypeVar("T")


def write_deadline(timeout: float | None) -> float | None:
    """A write's deadline on a tier whose calls answer within `timeout` (writes move
    whole chunks: longer)."""
    return None if timeout is None else max(30.0, 6 * timeout)


class TierGuard:
    """A deadline (`timeout` seconds; None: unbounded) and a breaker per tier."""

    def __init__(
        self, tiers: Sequence[Tier], labels: Sequence[str], metrics: StoreMetrics, timeout: float | None
    ) -> None:
        self.tiers = list(tiers)
        self.labels = list(labels)
        self.metrics = metrics
        self.timeout = timeout
        self.breakers = [
            CircuitBreaker(failure_threshold=1, reset_after=1.0, max_reset_after=30.0) for _ in self.tiers
        ]

    def available(self, j: int) -> bool:
        """Is tier `j`'s breaker closed (calls go through)?"""
        return self.breakers[j].state is BreakerState.CLOSED

    def refusing(self, j: int) -> bool:
        """Does tier `j`'s breaker fail calls fast right now?"""
        return self.breakers[j].refusing()

    async def call(self, j: int, coro: Coroutine[Any, Any, T], default: T, what: str, *, write: bool = False) -> T:
        """`coro` on tier `j` under the tier deadline; `default` if the tier fails or is slow.

        The first deadline miss or error opens tier `j`'s breaker: later calls return
        `default` at once (counted as refused) until a probe after the breaker's wait
        succeeds.  Other tiers are not affected.  Writes get a longer deadline (they move
        whole chunks).  Without a timeout calls are not bounded here.
        """
        breaker = self.breakers[j]
        if not breaker.allow():
            coro.close()
            self.metrics.errors.labels(op=f"{what} refused", tier=self.labels[j]).inc()
            return default
        timeout = write_deadline(self.timeout) if write else self.timeout
        try:
            result = await within(coro, timeout)
        except asyncio.TimeoutError:
            breaker.record(False)
            self.metrics.errors.labels(op=f"{what} timeout", tier=self.labels[j]).inc()
            log.warning(
                "kvstore: %s on %s took longer than %.1fs; a miss, and this tier fails fast until it answers",
                what,
                self.tiers[j].name,
                timeout,
            )
            return default
        except Exception as exc:  # a tier that cannot answer holds nothing we can use now
            breaker.record(False)
            self.metrics.errors.labels(op=what, tier=self.labels[j]).inc()
            log.warning("kvstore: %s on %s failed: %s", what, self.tiers[j].name, exc)
            return default
        breaker.record(True)
        return result

    async def contains(self, j: int, names: Sequence[str]) -> list[bool]:
        """`contains_many` on tier `j`; all False if it does not answer."""
        return await self.call(j, self.tiers[j].contains_many(names), [False] * len(names), "contains")

    async def delete(self, j: int, names: Sequence[str]) -> list[bool]:
        """`delete_many` on tier `j`; all False if it does not answer."""
        return await self.call(j, self.tiers[j].delete_many(names), [False] * len(names), "delete")
