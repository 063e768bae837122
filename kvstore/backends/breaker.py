"""A circuit breaker: stop calling a failing server, probe it later, recover on success.

Owns: the closed → open → half-open state machine and its timing.  Pure: no I/O, no
asyncio, the clock is injected; backends call `allow()` before an operation and
`record(ok)` after it.  Must not touch: retries (the client library's job) or errors.

* closed: every call is allowed; `failure_threshold` consecutive failures open it.
* open: calls are refused (the caller counts them as failed) for `reset_after` seconds.
* half-open: after that wait, up to `probes` calls go through.  A success closes the
  breaker; a failure opens it again with the wait doubled (up to `max_reset_after`).
  Unlike a breaker that only ever opens, a recovered server is used again on its own.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5
    reset_after: float = 1.0
    max_reset_after: float = 30.0
    probes: int = 1
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = field(default=BreakerState.CLOSED, init=False)
    failures: int = field(default=0, init=False)
    opened: int = field(default=0, init=False)  # times it has opened, for stats
    refused: int = field(default=0, init=False)  # calls refused while open
    _open_until: float = field(default=0.0, init=False)
    _wait: float = field(default=0.0, init=False)
    _probes_out: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.probes < 1:
            raise ValueError("failure_threshold and probes must be at least 1")
        if self.reset_after <= 0 or self.max_reset_after < self.reset_after:
            raise ValueError("need 0 < reset_after <= max_reset_after")
        self._wait = self.reset_after

    def refusing(self) -> bool:
        """Would a call be refused now?  (Unlike `allow`, takes no probe slot.)"""
        return self.state is BreakerState.OPEN and self.clock() < self._open_until

    def allow(self) -> bool:
        """May a call go out now?  (Takes a probe slot when half-open.)"""
        if self.state is BreakerState.OPEN:
            if self.clock() < self._open_until:
                self.refused += 1
                return False
            self.state = BreakerState.HALF_OPEN
            self._probes_out = 0
        if self.state is BreakerState.HALF_OPEN:
            if self._probes_out >= self.probes:
                self.refused += 1
                return False
            self._probes_out += 1
        return True

    def record(self, ok: bool) -> None:
        """Report the outcome of a call that `allow()` let through."""
        if ok:
            self.failures = 0
            if self.state is not BreakerState.CLOSED:
                self.state = BreakerState.CLOSED
                self._wait = self.reset_after
            return
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._wait = min(self._wait * 2, self.max_reset_after)
            self._open()
        elif self.state is BreakerState.CLOSED and self.failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened += 1
        self._open_until = self.clock() + self._wait
        self._probes_out = 0

    def snapshot(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "consecutive_failures": self.failures,
            "opened": self.opened,
            "refused": self.refused,
        }
