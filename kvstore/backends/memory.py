"""In-process hot tier: ``mem://NAME?capacity=4GiB[&preallocate=true]``.

Owns: a dict of objects bounded in bytes (``capacity``), least recently used evicted
first; the names evicted go to `Backend.on_evict`.
Zero-copy on get: the returned memoryview is read-only and shares the stored buffer
(with `alloc`, the object is copied once into the caller's buffer instead).  A put
copies each object once into memory it owns, since callers reuse their buffers.  With a
``capacity``, objects of 256 KiB and up are kept in one mapping of that size
(`memory_arena`): once its pages are touched they stay, and a full tier's next object
lands in an evicted one's pages instead of faulting fresh ones in.  ``preallocate=true``
touches them all when the tier opens (LMCache does so for its CPU pool; 1.8 s per GiB
measured in a sandboxed kernel here), so the first puts run at copy speed too.

Backends with the same NAME in one process share their contents, so a URL names the
same store wherever it is opened; ``mem://`` (no name) is private to its instance.
"""

from __future__ import annotations

import asyncio
import builtins
import ctypes
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Union
from urllib.parse import urlsplit

import numpy as np

from kvstore.backends.base import (
    MAX_OBJECT_OPTION,
    MEMORY_LOOKUP_MOST,
    Alloc,
    Backend,
    BackendStats,
    BackendUnavailableError,
    Capabilities,
    ObjectInfo,
    Value,
    as_parts,
    redact_url,
)
from kvstore.backends.memory_arena import ARENA_MIN, Arena, Region
from kvstore.keys import InvalidKeyError, check_object_name
from kvstore.options import option_bool, option_size, url_options

log = logging.getLogger(__name__)

COPY_OFF_LOOP = 1 << 20  # objects this large are copied in on a worker thread (without the GIL)


@dataclass(slots=True)
class _Object:
    data: Union[bytes, Region]
    size: int
    mtime: float

    def view(self) -> memoryview:
        """The object's bytes, read-only (a view of a region holds it: `memory_arena`)."""
        data = self.data
        return (data.view(self.size) if isinstance(data, Region) else memoryview(data)).toreadonly()


@dataclass(eq=False, slots=True)
class _Pending:
    """An object being put: room reserved, bytes not yet copied or visible."""

    name: str
    parts: list[memoryview]
    size: int
    arena: Arena | None  # the arena the region came from (None: the tier has none)
    region: Region | None  # None: the bytes go to a ``bytes`` object instead
    data: Union[bytes, Region, None] = None  # set once the bytes are in
    error: Exception | None = None

    def try_fill(self) -> None:
        """`fill`, keeping its error instead of raising it (`_publish` reports it)."""
        try:
            self.fill()
        except Exception as exc:
            self.error = exc

    def fill(self) -> None:
        """Copy the parts in: into the region (parts of `COPY_OFF_LOOP` and up by
        ``ctypes.memmove``, which runs without the GIL, so a worker thread's copy leaves
        the loop running), else into a new ``bytes``."""
        region, parts = self.region, self.parts
        if region is None:
            self.data = b"".join(parts)
            return
        base = ctypes.addressof(region.exporter)
        at = 0
        with region.view(self.size) as view:
            for part in parts:
                n = part.nbytes
                if n >= COPY_OFF_LOOP:  # ctypes calls release the GIL
                    ctypes.memmove(base + at, np.frombuffer(part, dtype=np.uint8).ctypes.data, n)
                elif n:
                    view[at : at + n] = part
                at += n
        self.data = region


@dataclass
class _Space:
    objects: OrderedDict[str, _Object] = field(default_factory=OrderedDict)  # LRU first
    used: int = 0
    arena: Arena | None = None
    # a named space may be shared by stores on different event loops (threads)
    lock: threading.RLock = field(default_factory=threading.RLock)


_SHARED: dict[str, _Space] = {}


class MemoryBackend(Backend):
    schemes = ("mem",)
    capabilities = Capabilities(in_memory=True, enforces_capacity=True)

    def __init__(
        self, url: str = "mem://", capacity: int | None = None, *, preallocate: bool = False
    ) -> None:
        super().__init__(url)
        name = urlsplit(url).netloc
        self._space = _SHARED.setdefault(name, _Space()) if name else _Space()
        self.capacity = capacity
        space = self._space
        with space.lock:
            if capacity is not None and space.arena is None:  # the first bounded opener's size
                try:
                    space.arena = Arena(capacity, populate=preallocate)
                except OSError as exc:
                    if preallocate:
                        raise BackendUnavailableError(
                            f"{redact_url(url)}: cannot preallocate {capacity} bytes ({exc}); lower capacity "
                            "or drop preallocate=true"
                        ) from exc
                    log.warning(
                        "kvstore: %s: no arena (%s); objects kept in plain bytes", redact_url(url), exc
                    )
            elif space.arena is not None and (
                (preallocate and not space.arena.populated) or (capacity or 0) > space.arena.capacity
            ):
                log.warning(
                    "kvstore: %s: %r was opened earlier in this process with a smaller capacity or without "
                    "preallocate=true; its first opening's arena serves (objects beyond it kept in plain bytes)",
                    redact_url(url),
                    name,
                )
        self._private = not name

    @classmethod
    def from_url(cls, url: str) -> MemoryBackend:
        opts = url_options(url, {"capacity", "preallocate", MAX_OBJECT_OPTION})
        capacity = option_size("capacity", opts.get("capacity"))
        preallocate = option_bool("preallocate", opts.get("preallocate"), default=False)
        if preallocate and capacity is None:
            raise ValueError(f"{url!r}: preallocate=true needs a capacity (e.g. capacity=4GiB)")
        backend = cls(url, capacity=capacity, preallocate=preallocate)
        backend.set_max_object(opts.get(MAX_OBJECT_OPTION))
        return backend

    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        """Each object gets its room under the space's lock (evicting as needed), its
        bytes are copied outside the lock (objects of `COPY_OFF_LOOP` and up on worker
        threads, without the GIL, several at once), and it is published under the lock:
        readers see it whole or not at all.  A caller that stops waiting (a deadline)
        does not stop the copies: they finish and publish, so no room stays reserved."""
        with self._space.lock:
            plans = [self._reserve(name, value) for name, value in items]
        big = [p for p in plans if p is not None and p.size >= COPY_OFF_LOOP]
        if not big:  # copied on the loop, nothing awaited: it cannot be left half done
            return await self._copy_in(plans, big)
        return await asyncio.shield(asyncio.ensure_future(self._copy_in(plans, big)))

    async def _copy_in(self, plans: list[_Pending | None], big: list[_Pending]) -> list[bool]:
        for p in plans:
            if p is not None and p.size < COPY_OFF_LOOP:
                p.try_fill()
        if big:
            await asyncio.gather(*(asyncio.to_thread(p.try_fill) for p in big))
        with self._space.lock:
            return [p is not None and self._publish(p) for p in plans]

    def _reserve(self, name: str, value: Value) -> _Pending | None:
        """Room for `value` under `name`: an older object of that name dropped, least
        recently used ones evicted, its size counted in ``used``; a region of the arena
        from `ARENA_MIN` up, else (also when no free extent is long enough: regions still
        viewed by readers of dropped objects, or split by mixed sizes) plain ``bytes``,
        so a put never waits on a reader.  Not visible until `_publish`.  None when it
        cannot be stored."""
        try:
            check_object_name(name)
        except InvalidKeyError:
            self.counters.put_errors += 1
            return None
        parts = as_parts(value)
        size = sum(p.nbytes for p in parts)
        if (self.capacity is not None and size > self.capacity) or self.too_large(name, size):
            self.counters.rejected += 1
            return None
        self._drop(name)
        self._make_room(size)
        arena = self._space.arena
        region = arena.alloc(size) if arena is not None and size >= ARENA_MIN else None
        self._space.used += size
        return _Pending(name, parts, size, arena, region)

    def _publish(self, p: _Pending) -> bool:
        """Make a filled object visible; a failed copy gives its room back instead."""
        space = self._space
        if p.arena is not space.arena:  # the tier was closed meanwhile
            return False
        if p.data is None:
            log.warning(
                "kvstore: %s: copying %s into memory failed: %s", redact_url(self.url), p.name, p.error
            )
            self._unreserve(p)
            return False
        self._drop(p.name)  # another put of the name, published while this one copied
        space.objects[p.name] = _Object(p.data, p.size, time.time())
        self.counters.puts += 1
        self.counters.put_bytes += p.size
        return True

    def _unreserve(self, p: _Pending) -> None:
        self._space.used -= p.size
        if p.region is not None and p.arena is not None:
            p.arena.free(p.region)

    def _drop(self, name: str) -> bool:
        old = self._space.objects.pop(name, None)
        if old is None:
            return False
        self._space.used -= old.size
        if isinstance(old.data, Region):
            assert self._space.arena is not None
            self._space.arena.free(old.data)
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
        with self._space.lock:
            return self._get_many(names, alloc)

    def _get_many(self, names: Sequence[str], alloc: Alloc | None) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for name in names:
            self.counters.gets += 1
            entry = self._space.objects.get(name)
            if entry is None:
                self.counters.misses += 1
                out.append(None)
                continue
            size = entry.size
            self._space.objects.move_to_end(name)
            self.counters.hits += 1
            self.counters.get_bytes += size
            if alloc is None:
                out.append(entry.view())
            else:
                buf = alloc(size)[:size]
                with entry.view() as view:
                    buf[:] = view
                out.append(buf)
        return out

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        return self.contains_now(names)

    def contains_now(self, names: Sequence[str]) -> list[bool]:
        return [n in self._space.objects for n in names]

    def contains_now_batch(self) -> int:
        return MEMORY_LOOKUP_MOST  # a dict lookup a name: no reason to stop early

    def contains_now_most(self) -> int:
        return MEMORY_LOOKUP_MOST

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        with self._space.lock:
            out = [self._drop(n) for n in names]
        self.counters.deletes += sum(out)
        return out

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        with self._space.lock:
            listed = list(self._space.objects.items())
        for name, obj in listed:
            if name.startswith(prefix):
                yield ObjectInfo(name, obj.size, obj.mtime)

    async def retention_risks(self) -> builtins.list[str]:
        """Besides a byte budget: the objects live in this process's memory only."""
        return [
            *await super().retention_risks(),
            f"{redact_url(self.url)} keeps objects in this process's memory only, so they are gone "
            "when it exits; migrate to a file://, redis:// or s3:// store instead",
        ]

    async def close(self) -> None:
        """A private tier (``mem://`` without a name) lets its objects and arena go; a
        named one keeps them for the process's other openers."""
        if self._private:
            with self._space.lock:
                self._space.objects.clear()
                self._space.used = 0
                self._space.arena = None

    def stats(self) -> BackendStats:
        space = self._space
        with space.lock:
            arena = space.arena
            extra = (
                {}
                if arena is None
                else {
                    "arena_bytes": arena.capacity,
                    "arena_taken_bytes": arena.taken,
                    "arena_retired_bytes": arena.retired_bytes,  # dropped, still viewed by a reader
                    "preallocated": arena.populated,
                }
            )
            return BackendStats(
                url=redact_url(self.url),
                objects=len(space.objects),
                bytes=space.used,
                capacity_bytes=self.capacity,
                counters=self.counters,
                extra=extra,
            )
