"""Disk baseline: ``os.write`` + ``os.fsync`` in an executor, ``os.preadv`` into a reused buffer."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvstore.options import option_bool, url_options


class Baseline:
    name = "os.write+fsync / os.preadv"

    async def open(self, url: str) -> None:
        opts = url_options(url, {"capacity", "fsync", "concurrency"})
        self.fsync = option_bool("fsync", opts.get("fsync"), True)
        self.dir = Path(unquote(urlsplit(url).path)) / "bench-baseline"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _put(self, i: int, data: memoryview) -> None:
        fd = os.open(self.dir / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while data:
                data = data[os.write(fd, data) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _get(self, i: int, into: memoryview) -> int:
        fd = os.open(self.dir / f"{i}", os.O_RDONLY)
        try:
            return os.preadv(fd, [into], 0)
        finally:
            os.close(fd)

    async def put(self, i: int, data: memoryview) -> None:
        await asyncio.to_thread(self._put, i, data)

    async def get(self, i: int, into: memoryview) -> int:
        return await asyncio.to_thread(self._get, i, into)

    def paths(self) -> list[Path]:
        return list(self.dir.iterdir())

    async def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
