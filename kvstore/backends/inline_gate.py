"""When a tier may answer a lookup on the caller's thread: the back-off after slow answers.

Owns: `InlineGate`, pure bookkeeping over times its caller measures.  A lookup answered
on the caller's thread (LMCache's, or the event loop: a disk tier's ``stat``, a Redis
tier's ``TYPE`` round trip) saves two thread hops, but must not hold that thread when
the medium is slow.  The caller asks `open` before it tries, and reports each answer's
time (`answered`) or a failure (`failed`).  One slow answer may be a busy process (its
time includes waiting for the GIL and for a core); the second in a row closes the gate
for `BACKOFF_S` [0] (a second), each further one (the first after the last back-off)
for twice the last, at most `BACKOFF_S` [1]; a fast answer forgets the streak.  A
failure closes it at once, as a second slow answer does.  Must not touch: the medium
itself, threads, logging (the caller logs the back-offs `answered` and `failed`
return).
"""

from __future__ import annotations

BACKOFF_S = (1.0, 60.0)  # the first back-off, and the longest


class InlineGate:
    """Whether answering on the caller's thread is allowed now (see the module docstring)."""

    def __init__(self, *, closed: bool = False) -> None:
        """`closed`: never open (e.g. a network file system, where a stat is a round trip)."""
        self._after = float("inf") if closed else 0.0  # open again at this time
        self._slow = 0  # slow answers in a row
        self._backoff = 0.0  # the last back-off

    def open(self, now: float) -> bool:
        return now >= self._after

    def answered(self, t0: float, t1: float, limit: float) -> float:
        """An answer that took from `t0` to `t1`, slow past `limit` seconds.  Returns the
        back-off it starts when that is worth a log line (see `_back_off`), else 0.0."""
        if t1 - t0 < limit:
            self._slow = 0
            return 0.0
        self._slow += 1
        return self._back_off(t1) if self._slow >= 2 else 0.0

    def failed(self, now: float) -> float:
        """The medium failed (or timed out) an answer: back off now.  Returns the back-off
        when worth a log line, else 0.0."""
        self._slow = max(self._slow + 1, 2)
        return self._back_off(now)

    def _back_off(self, now: float) -> float:
        """Close the gate; the back-off when it is the first of a streak or the first to
        reach the longest (the ones a log should show), else 0.0."""
        first, most = BACKOFF_S
        last = 0.0 if self._slow == 2 else self._backoff
        self._backoff = min(most, 2 * last) if last else first
        self._after = now + self._backoff
        return self._backoff if not last or self._backoff >= most > last else 0.0
