"""Helpers for TieredStore tests: memory backends whose writes, or deletes and reads, wait on gates; a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.backends.base import Alloc, Value
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


class HeldMemoryBackend(MemoryBackend):
    """A private mem:// backend whose deletes wait for `deletes`, and whose reads wait for
    `reads_in` before reading and `reads_out` before answering (all set: nothing held)."""

    def __init__(self) -> None:
        super().__init__("mem://")
        self.deletes = asyncio.Event()
        self.reads_in = asyncio.Event()
        self.reads_out = asyncio.Event()
        for gate in (self.deletes, self.reads_in, self.reads_out):
            gate.set()

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        await self.deletes.wait()
        return await super().delete_many(names)

    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]:
        await self.reads_in.wait()
        got = await super().get_many(names, alloc)
        await self.reads_out.wait()
        return got


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
