"""Helpers for TieredStore tests: a memory backend whose writes wait on a gate, a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.backends.base import Value
from kvstore.backends.memory import MemoryBackend


class GatedMemoryBackend(MemoryBackend):
    """A private mem:// backend whose put_many waits until `gate` is set (to hold writes in flight)."""

    def __init__(self) -> None:
        super().__init__("mem://")
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return await super().put_many(items)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
