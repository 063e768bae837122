"""In-process hot tier: ``mem://NAME?capacity=4GiB``.

Owns: a dict of objects bounded in bytes (``capacity``), least recently used evicted
first; the names evicted go to `Backend.on_evict`.
Zero-copy on get: the returned memoryview is read-only and shares the stored buffer
(with `alloc`, the object is copied once into the caller's buffer instead).  A put
copies each object once into memory it owns, since callers reuse their buffers.

Backends with the same NAME in one process share their contents, so a URL names the
same store wherever it is opened; ``mem://`` (no name) is private to its instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.backends.base import (
    MAX_OBJECT_OPTION,
    Alloc,
    Backend,
    BackendStats,
    Capabilities,
    ObjectInfo,
    Value,
    as_parts,
    redact_url,
)
from kvstore.keys import InvalidKeyError, check_object_name
from kvstore.options import option_size, url_options


@dataclass
class _Space:
    objects: OrderedDict[str, tuple[bytes, float]] = field(default_factory=OrderedDict)  # LRU first
    used: int = 0


_SHARED: dict[str, _Space] = {}


class MemoryBackend(Backend):
    schemes = ("mem",)
    capabilities = Capabilities(in_memory=True, enforces_capacity=True)

    def __init__(self, url: str = "mem://", capacity: int | None = None) -> None:
        super().__init__(url)
        name = urlsplit(url).netloc
        self._space = _SHARED.setdefault(name, _Space()) if name else _Space()
        self.capacity = capacity

    @classmethod
    def from_url(cls, url: str) -> MemoryBackend:
        opts = url_options(url, {"capacity", MAX_OBJECT_OPTION})
        backend = cls(url, capacity=option_size("capacity", opts.get("capacity")))
        backend.set_max_object(opts.get(MAX_OBJECT_OPTION))
        return backend

    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        import time

        out = []
        for name, value in items:
            try:
                check_object_name(name)
            except InvalidKeyError:
                self.counters.put_errors += 1
                out.append(False)
                continue
            parts = as_parts(value)
            size = sum(p.nbytes for p in parts)
            if (self.capacity is not None and size > self.capacity) or self.too_large(name, size):
                self.counters.rejected += 1
                out.append(False)
                continue
            self._drop(name)
            self._make_room(size)
            data = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
            self._space.objects[name] = (data, time.time())
            self._space.used += size
            self.counters.puts += 1
            self.counters.put_bytes += size
            out.append(True)
        return out

    def _drop(self, name: str) -> bool:
        old = self._space.objects.pop(name, None)
        if old is None:
            return False
        self._space.used -= len(old[0])
        return True

    def _make_room(self, size: int) -> None:
        if self.capacity is None:
            return
        space = self._space
        victims = []
        while space.used + size > self.capacity and space.objects:
            victim = next(iter(space.objects))  # least recently used
            self._drop(victim)
            victims.append(victim)
        self.evicted(victims)

    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for name in names:
            self.counters.gets += 1
            entry = self._space.objects.get(name)
            if entry is None:
                self.counters.misses += 1
                out.append(None)
                continue
            data = entry[0]
            self._space.objects.move_to_end(name)
            self.counters.hits += 1
            self.counters.get_bytes += len(data)
            if alloc is None:
                out.append(memoryview(data))
            else:
                buf = alloc(len(data))[: len(data)]
                buf[:] = data
                out.append(buf)
        return out

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        return [n in self._space.objects for n in names]

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        out = [self._drop(n) for n in names]
        self.counters.deletes += sum(out)
        return out

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for name, (data, mtime) in list(self._space.objects.items()):
            if name.startswith(prefix):
                yield ObjectInfo(name, len(data), mtime)

    def stats(self) -> BackendStats:
        return BackendStats(
            url=redact_url(self.url),
            objects=len(self._space.objects),
            bytes=self._space.used,
            capacity_bytes=self.capacity,
            counters=self.counters,
        )
