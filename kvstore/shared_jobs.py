"""A batch of blocking steps shared among a few worker jobs, each taking the next item.

Owns: `run_shared` (the items of a batch handed out one at a time from one queue to at
most ``jobs`` worker jobs, so a job that got the larger objects or a busier core does
not leave the others idle at the end; results in the items' order).  Must not touch:
what a step does (the caller's function), which executor runs the jobs (the caller's
``start``).

A batch split into fixed groups up front ends when its slowest group ends: 8 reads of
16 MiB in two groups of four on a 2-core machine finished 1.7 ms apart when one core
also ran the event loop.  Taken from a shared queue, each job keeps going until none
is left, and the batch ends at most one item's time after its first job is idle.

Cancellation: the items not yet begun are dropped (their result stays None) and the
steps under way run to their end before `run_shared` re-raises, since they may be
writing into buffers the caller frees once it has left.  A job that cannot start leaves
the items to the others; its exception is raised once they have all ended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from kvstore.backends.stream import wait_out

T = TypeVar("T")
R = TypeVar("R")

#: runs one blocking job off the event loop (``loop.run_in_executor(None, job)`` by default)
Start = Callable[[Callable[[], None]], Awaitable[None]]


async def run_shared(
    step: Callable[[T], R], items: Sequence[T], jobs: int, start: Start | None = None
) -> list[R | Exception | None]:
    """``step(item)`` for every item on at most `jobs` worker jobs; each result in the
    item's place, an `Exception` a step raised in its place (the other items still run),
    None for an item a cancellation dropped before it began."""
    out: list[R | Exception | None] = [None] * len(items)
    if not items:
        return out
    queue: deque[int] = deque(range(len(items)))

    def job() -> None:
        while True:
            try:
                k = queue.popleft()  # atomic: two jobs never take the same item
            except IndexError:
                return
            try:
                out[k] = step(items[k])
            except Exception as exc:
                out[k] = exc

    if start is None:
        loop = asyncio.get_running_loop()

        def start(fn: Callable[[], None]) -> Awaitable[None]:
            return loop.run_in_executor(None, fn)

    run = start
    # every job's end awaited, whatever ends the others (a job that could not start must
    # not leave the rest writing into the caller's buffers after this returns)
    together = asyncio.gather(*(run(job) for _ in range(max(1, min(jobs, len(items))))), return_exceptions=True)
    try:
        ended = await asyncio.shield(together)
    except asyncio.CancelledError:
        queue.clear()
        await wait_out(together)
        raise
    for e in ended:
        if isinstance(e, BaseException):
            raise e
    return out


__all__ = ["Start", "run_shared"]
