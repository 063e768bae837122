"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

import pytest

from kvstore.backends.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fail(b: CircuitBreaker, n: int) -> None:
    for _ in range(n):
        assert b.allow()
        b.record(False)


def test_opens_after_threshold_consecutive_failures_only():
    b = CircuitBreaker(failure_threshold=3, reset_after=1.0, clock=Clock())
    fail(b, 2)
    assert b.allow()
    b.record(True)  # a success resets the count
    fail(b, 2)
    assert b.state is BreakerState.CLOSED
    fail(b, 1)
    assert b.state is BreakerState.OPEN
    assert not b.allow()
    assert b.refused == 1


def test_half_opens_after_wait_and_recovers_on_success():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_after=1.0, clock=clock)
    fail(b, 2)
    clock.now += 0.99
    assert not b.allow()
    clock.now += 0.02
    assert b.allow()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # only one probe at a time
    b.record(True)
    assert b.state is BreakerState.CLOSED
    assert all(b.allow() for _ in range(10))


def test_failed_probe_reopens_with_doubled_wait_capped():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_after=1.0, max_reset_after=3.0, clock=clock)
    fail(b, 1)
    waits = []
    for _ in range(4):
        start = clock.now
        while not b.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        b.record(False)
    assert waits == [1.0, 2.0, 3.0, 3.0]
    clock.now += 3.0
    assert b.allow()
    b.record(True)
    fail(b, 1)  # after recovery the wait starts again from reset_after
    clock.now += 1.0
    assert b.allow()
    assert b.opened == 6


def test_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_after=5.0, max_reset_after=1.0)
