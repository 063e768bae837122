"""`run_shared`: a batch's items handed out one at a time to a few worker jobs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvstore.shared_jobs import run_shared


async def test_results_come_back_in_the_items_order_with_faults_in_their_place() -> None:
    def step(x: int) -> int:
        if x == 3:
            raise ValueError("three")
        return x * x

    out = await run_shared(step, list(range(7)), jobs=2)
    assert [v for k, v in enumerate(out) if k != 3] == [0, 1, 4, 16, 25, 36]
    assert isinstance(out[3], ValueError) and str(out[3]) == "three"


async def test_a_job_held_up_on_one_item_leaves_the_rest_to_the_others() -> None:
    """Fixed groups would leave items queued behind the slow one; shared, they are not."""
    taken: dict[int, str] = {}
    release = threading.Event()

    def step(x: int) -> int:
        taken[x] = threading.current_thread().name
        if x == 0:
            release.wait(5)
        return x

    task = asyncio.ensure_future(run_shared(step, list(range(8)), jobs=2))
    deadline = time.monotonic() + 5
    while len(taken) < 8 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert len(taken) == 8  # every item done while item 0 still holds its job
    release.set()
    assert await task == list(range(8))
    assert len({taken[k] for k in range(1, 8)}) == 1 and taken[0] not in {taken[k] for k in range(1, 8)}


async def test_cancelled_it_begins_no_more_items_and_returns_only_once_the_running_ones_end() -> None:
    started: list[int] = []
    running = threading.Event()
    finished: list[int] = []

    def step(x: int) -> int:
        started.append(x)
        running.set()
        time.sleep(0.2)
        finished.append(x)
        return x

    task = asyncio.ensure_future(run_shared(step, list(range(10)), jobs=2))
    while not running.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(finished) == sorted(started)  # nothing still running once it raised
    assert len(started) <= 4  # the two under way, at most one more each before the queue emptied
    await asyncio.sleep(0.3)
    assert sorted(finished) == sorted(started)  # and nothing began afterwards


async def test_it_runs_the_jobs_through_the_callers_start() -> None:
    starts: list[int] = []

    async def start(job):  # type: ignore[no-untyped-def]
        starts.append(1)
        await asyncio.get_running_loop().run_in_executor(None, job)

    assert await run_shared(lambda x: x + 1, [1, 2, 3], jobs=8, start=start) == [2, 3, 4]
    assert len(starts) == 3  # never more jobs than items
