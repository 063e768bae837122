"""Memory baseline: a dict of ``bytes``, copied out into a reused buffer."""

from __future__ import annotations


class Baseline:
    name = "dict of bytes"

    async def open(self, url: str) -> None:
        self.objects: dict[int, bytes] = {}

    async def put(self, i: int, data: memoryview) -> None:
        self.objects[i] = data.tobytes()

    async def get(self, i: int, into: memoryview) -> int:
        data = self.objects[i]
        into[: len(data)] = data
        return len(data)

    async def close(self) -> None:
        self.objects.clear()
