"""Awaiting with a deadline, without a task of its own where Python allows.

Owns: `within(aw, timeout)`: ``await aw``, raising `TimeoutError` (``asyncio.TimeoutError``)
once `timeout` seconds have passed (None: no deadline).  On Python 3.11 ``asyncio.wait_for``
wraps a coroutine in a task of its own, two more turns of the event loop per call; every
tier call, lookup, load and store passes one or two deadlines, so this uses
``asyncio.timeout`` there (3.12's ``wait_for`` does the same itself); before 3.11.3 it
is ``wait_for``.  Must not touch: what is awaited.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11, 3):  # before 3.11.3 a pending cancel could leave it as CancelledError

    async def within(aw: Awaitable[T], timeout: float | None) -> T:
        async with asyncio.timeout(timeout):
            return await aw

else:  # pragma: no cover - Python 3.10 to 3.11.2

    async def within(aw: Awaitable[T], timeout: float | None) -> T:
        return await asyncio.wait_for(aw, timeout)


__all__ = ["within"]
