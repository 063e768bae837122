"""Local-disk warm tier: ``file:///path?capacity=100GiB&fsync=true``.

Owns: the on-disk layout under one root directory, the in-memory index of what is
there (rebuilt by a scan at open), byte-budget eviction through an `Evictor` (LRU by
default), crash-safe writes and the quarantine folder.  Must not touch: frame parsing
(the tier above validates objects and calls `quarantine`), tensors.

Layout::

    ROOT/objects/<2 hex>/<escaped name>   one file per object, shard = digest of name
    ROOT/objects/<2 hex>/.<pid>-<n>.tmp   a write in progress; removed at open
    ROOT/quarantine/                      objects the tier found corrupt, with .reason

* A write goes to a temp file beside its target (preallocated, one ``writev`` of
  header and payload), is fsync'ed (``fsync=false`` to skip), then renamed over its
  real name, so a crash never leaves a torn object under a real name, and two
  concurrent writers of one name each publish a whole object (the last rename wins).
  Same-directory temp files with ``fallocate`` measured ~20% faster than a separate
  temp folder (docs/benchmarks/core.md).
* Reads land in the caller's buffer (`alloc`) with ``preadv``, never a fresh
  ``bytes``.  A file written by another process after the index was built is still
  found (a miss in the index falls back to the file system).
* Blocking calls run in aiofiles' executor: one hop per write; one per read when the
  index knows the object's size (allocate, then open + ``preadv`` + close), else two.
* ``read_streamed`` (see `kvstore.backends.stream`) reads an object's head, lets the
  reader pick where the rest lands, and hands it each block as it arrives: one hop.
* ENOSPC, EACCES and files vanishing underneath are counted errors / misses.

File names are the object name percent-escaped (``/`` → ``%2F``, ``.`` → ``%2E``), so
they are reversible and never start with ``.``; the index is rebuilt from a directory
scan.  A name whose escaped form is too long for a file name is stored as ``~`` +
digest with a ``.name`` side file holding the name; a leading ``~`` of a short name is
escaped, so the two kinds of file name never meet.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import itertools
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote, urlsplit

import aiofiles.os

from kvstore.backends.base import (
    MAX_OBJECT_OPTION,
    Alloc,
    Backend,
    BackendStats,
    BackendUnavailableError,
    ObjectInfo,
    Value,
    as_parts,
    bytearray_alloc,
    parts_len,
    redact_url,
)
from kvstore.backends.stream import STREAM_BLOCK, StreamSink
from kvstore.config import option_int, option_size, parse_bool, url_options
from kvstore.eviction import Evictor, LRUEvictor
from kvstore.keys import InvalidKeyError, check_object_name, printable_name

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_FILENAME = 250
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ids = itertools.count()


def encode_filename(name: str) -> str:
    """The file name of object `name`: percent-escaped, or ``~`` + digest when too long.

    The two spaces are disjoint: an escaped name never starts with ``~`` (a leading
    ``~`` is written ``%7E``), so no name can be stored under another one's digest.
    """
    enc = quote(name, safe="-_").replace(".", "%2E")
    if enc.startswith("~"):
        enc = "%7E" + enc[1:]
    if len(enc) <= MAX_FILENAME:
        return enc
    return "~" + hashlib.blake2b(name.encode(), digest_size=20).hexdigest()


def shard_of(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=1).hexdigest()


@aiofiles.os.wrap
def _write_object(path: Path, name: str, parts: list[memoryview], size: int, fsync: bool) -> None:
    """Publish one object atomically: temp file beside it, fallocate, writev, fsync, rename.

    The shard directory (and the store's, if it was removed while running) is made here.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{os.getpid()}-{next(_ids)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, before any byte is written
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        pending = [p for p in parts if p.nbytes]
        while pending:
            n = os.writev(fd, pending[:IOV_MAX])
            while n:
                if n >= pending[0].nbytes:
                    n -= pending.pop(0).nbytes
                else:
                    pending[0] = pending[0][n:]
                    n = 0
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        if path.name.startswith("~"):
            Path(f"{path}.name").write_text(name, "utf-8")
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _Defective(Exception):
    """What is at an object's path cannot be that object (a directory, a file larger than
    any object written here); the reader quarantines it and serves a miss."""


def _check_stat(st: os.stat_result, max_size: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Defective("not a regular file")
    if st.st_size > max_size:
        raise _Defective(f"{st.st_size} bytes, over {MAX_OBJECT_OPTION}={max_size}")


@aiofiles.os.wrap
def _open_read(path: Path, max_size: int) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        st = os.fstat(fd)
        _check_stat(st, max_size)
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def _pread_into(fd: int, buf: memoryview, offset: int = 0) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if not n:
            break
        got += n
    return got


@aiofiles.os.wrap
def _read_all(fd: int, buf: memoryview) -> int:
    try:
        return _pread_into(fd, buf)
    finally:
        os.close(fd)


@aiofiles.os.wrap
def _read_sized(path: Path, buf: memoryview) -> int:
    """Open, read the whole object into `buf` and close: -1 if its size is not len(buf)."""
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Defective("not a regular file")
        if st.st_size != len(buf):
            return -1  # rewritten since it was indexed: the caller asks again
        return _pread_into(fd, buf)
    finally:
        os.close(fd)


@aiofiles.os.wrap
def _read_streamed(path: Path, sink: StreamSink, max_size: int) -> tuple[int, int, object]:
    """(object size, bytes read, the sink's verdict); see `kvstore.backends.stream`."""
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        st = os.fstat(fd)
        _check_stat(st, max_size)
        size = st.st_size
        head = memoryview(bytearray(min(size, sink.head)))
        got = _pread_into(fd, head)
        where = sink.body(head[:got], size)
        if where is not None:
            dst, offset = where
            for start in range(0, len(dst), STREAM_BLOCK):
                block = dst[start : start + STREAM_BLOCK]
                n = _pread_into(fd, block, offset + start)
                got += n
                sink.feed(block[:n])
                if n < len(block):
                    break
        return size, got, sink.finish()
    finally:
        os.close(fd)


class DiskBackend(Backend):
    schemes = ("file",)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        fsync: bool = True,
        concurrency: int = 4,
        evictor: Evictor | None = None,
        url: str | None = None,
        max_object: int | str | None = None,
    ) -> None:
        super().__init__(url or Path(root).absolute().as_uri())
        self.set_max_object(max_object)
        option_int("concurrency", concurrency)
        if capacity is not None:
            option_size("capacity", capacity)
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.objects_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.fsync = fsync
        self.evictor: Evictor = evictor or LRUEvictor()
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._pending = 0  # bytes of writes in progress, reserved against the budget
        self._reading: dict[str, int] = {}
        self._sem = asyncio.Semaphore(concurrency)
        self._write_done = asyncio.Condition()
        self._scan()

    @classmethod
    def open_existing(cls, url: str) -> DiskBackend:
        """Open a store that must already be there (read-only commands): a path that does not
        exist is `BackendUnavailableError`, and nothing is created."""
        root = Path(unquote(urlsplit(url).path))
        if not (root / "objects").is_dir():
            what = "does not exist" if not root.exists() else "is not a kvstore disk store (no objects/)"
            raise BackendUnavailableError(f"{redact_url(url)}: {root} {what}; check the path")
        return cls.from_url(url)

    @classmethod
    def from_url(cls, url: str) -> DiskBackend:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"{redact_url(url)!r}: file URLs name a local path: file:///abs/path or file://localhost/abs/path"
            )
        if not parts.path:
            raise ValueError(f"{redact_url(url)!r} has no path; write file:///var/cache/kvstore")
        opts = url_options(url, {"capacity", "fsync", "concurrency", MAX_OBJECT_OPTION})
        return cls(
            unquote(parts.path),
            capacity=option_size("capacity", opts.get("capacity")),
            fsync=parse_bool(opts.get("fsync"), True),
            concurrency=option_int("concurrency", opts.get("concurrency", 4)),
            url=url,
            max_object=opts.get(MAX_OBJECT_OPTION),
        )

    # ---- index --------------------------------------------------------------
    def _entries(
        self, *, clean: bool = False, problems: list[tuple[str, str]] | None = None
    ) -> list[tuple[str, os.stat_result]]:
        """(name, stat) of every stored object; with `clean`, remove unfinished writes.

        What cannot be an object (a directory or other non-file where an object's file
        would be, an unreadable side file) is left out and described in `problems`.
        """
        out: list[tuple[str, os.stat_result]] = []
        try:
            shards = list(os.scandir(self.objects_dir))
        except FileNotFoundError:  # the store's directory was removed: the next put remakes it
            if problems is not None:
                problems.append((str(self.objects_dir), "the store's directory is gone"))
            return out
        for shard in shards:
            if not shard.is_dir():
                continue
            try:
                entries = list(os.scandir(shard.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith("."):  # a write in progress, or one a crash cut short
                    if clean:
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
                    continue
                if entry.name.endswith(".name"):
                    continue
                name = self._name_of(entry)
                if name is None:
                    if problems is not None:
                        problems.append((entry.path, "long-name file without a readable .name side file"))
                    continue
                if clean and entry.name.startswith("~"):
                    name = self._rename_legacy(entry, name)
                    if name is None:
                        continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if problems is not None:
                        problems.append((name, f"cannot stat: {exc}"))
                    continue
                if not stat.S_ISREG(st.st_mode):
                    if problems is not None:
                        problems.append((name, "not a regular file"))
                    continue
                out.append((name, st))
        return out

    def _scan(self) -> None:
        found = self._entries(clean=True)
        for name, st in sorted(found, key=lambda e: e[1].st_mtime):  # oldest first: LRU survives restarts
            self._index_add(name, st.st_size)

    @staticmethod
    def _rename_legacy(entry: os.DirEntry[str], name: str) -> str | None:
        """A short name starting with ``~`` stored by an older kvstore (as ``~...`` with a
        side file) moves to its escaped file name (``%7E...``); None if it cannot."""
        want = encode_filename(name)
        if want == entry.name or shard_of(name) != Path(entry.path).parent.name:
            return name
        try:
            os.replace(entry.path, Path(entry.path).parent / want)
            os.unlink(entry.path + ".name")
        except OSError as exc:
            log.warning("kvstore disk: could not rename %s to %s: %s", entry.path, want, exc)
            return None
        return name

    @staticmethod
    def _name_of(entry: os.DirEntry[str]) -> str | None:
        if entry.name.startswith("~"):
            try:
                return Path(entry.path + ".name").read_text("utf-8")
            except OSError:
                return None
        return unquote(entry.name)

    def _index_add(self, name: str, size: int) -> None:
        old = self._sizes.get(name)
        if old is not None:
            self._used -= old
        self._sizes[name] = size
        self._used += size
        self.evictor.insert(name, size)

    def _index_drop(self, name: str) -> int | None:
        size = self._sizes.pop(name, None)
        if size is not None:
            self._used -= size
            self.evictor.remove(name)
        return size

    def path_of(self, name: str) -> Path:
        return self.objects_dir / shard_of(name) / encode_filename(name)

    # ---- put ----------------------------------------------------------------
    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        return list(await asyncio.gather(*(self._put_one(n, v) for n, v in items)))

    async def _put_one(self, name: str, value: Value) -> bool:
        try:
            check_object_name(name)
        except InvalidKeyError as exc:
            log.warning("kvstore disk: refusing object name: %s", exc)
            self.counters.put_errors += 1
            return False
        parts = as_parts(value)
        size = parts_len(parts)
        if (self.capacity is not None and size > self.capacity) or self.too_large(name, size):
            self.counters.rejected += 1
            return False
        async with self._sem:
            if not await self._make_room(name, size):
                self.counters.rejected += 1
                return False
            self._pending += size
            try:
                await _write_object(self.path_of(name), name, parts, size, self.fsync)
            except OSError as exc:
                self.counters.put_errors += 1
                fatal = exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS)
                log.log(
                    logging.ERROR if fatal else logging.WARNING,
                    "kvstore disk: write of %s failed: %s",
                    name,
                    exc,
                )
                return False
            finally:
                self._pending -= size
                async with self._write_done:
                    self._write_done.notify_all()
        self._index_add(name, size)
        self.counters.puts += 1
        self.counters.put_bytes += size
        return True

    async def _make_room(self, name: str, size: int) -> bool:
        """Evict until `size` more bytes fit; False if they cannot (the budget is never exceeded)."""
        if self.capacity is None:
            return True
        while self._used + self._pending - self._sizes.get(name, 0) + size > self.capacity:
            victim = self.evictor.victim(protected={name, *self._reading})
            if victim is None:
                if not self._pending:
                    return False
                async with self._write_done:  # writes in flight become evictable when done
                    await self._write_done.wait()
                continue
            if not await self._remove(victim) and victim in self._sizes:
                return False  # cannot delete (read-only file system): nothing fits
            self.counters.evictions += 1
        return True

    async def _remove(self, name: str) -> bool:
        """True if the object existed and is gone now.  False if it was not there, or if
        it could not be removed (counted in ``delete_errors``; it stays indexed)."""
        path = self.path_of(name)
        try:
            await aiofiles.os.remove(path)
        except FileNotFoundError:  # gone already (another process deleted it)
            self._index_drop(name)
            return False
        except OSError as exc:
            log.error("kvstore disk: could not remove %s: %s", printable_name(name), exc)
            self.counters.delete_errors += 1
            return False
        self._index_drop(name)
        if path.name.startswith("~"):
            try:
                await aiofiles.os.remove(f"{path}.name")
            except OSError:
                pass
        return True

    # ---- get ----------------------------------------------------------------
    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]:
        return list(await asyncio.gather(*(self._get_one(n, alloc or bytearray_alloc) for n in names)))

    async def _get_one(self, name: str, alloc: Alloc) -> memoryview | None:
        async def read() -> tuple[int, int, memoryview]:
            size = self._sizes.get(name)
            if size is not None and size <= self.max_object_bytes:  # known size: allocate, one hop
                buf = alloc(size)[:size]
                got = await _read_sized(self.path_of(name), buf)
                if got >= 0:
                    return size, got, buf[:got]
            fd, size = await _open_read(self.path_of(name), self.max_object_bytes)
            try:
                buf = alloc(size)[:size]
            except BaseException:
                os.close(fd)
                raise
            got = await _read_all(fd, buf)  # closes fd
            return size, got, buf[:got]

        return await self._tracked_read(name, read)

    async def read_streamed(self, names: Sequence[str], open_sink) -> list[object | None]:
        """Each object streamed into the sink ``open_sink(name)`` gives (one hop per object);
        the sinks' verdicts, None for a miss or an I/O error."""
        sinks = [open_sink(n) for n in names]
        return list(
            await asyncio.gather(
                *(
                    self._tracked_read(n, partial(_read_streamed, self.path_of(n), s, self.max_object_bytes))
                    for n, s in zip(names, sinks)
                )
            )
        )

    async def _tracked_read(self, name: str, read: Callable[[], Awaitable[tuple[int, int, T]]]) -> T | None:
        """Run `read` -> (object size, bytes read, result) for one object with the
        bookkeeping every read shares: name check, reader count, index, LRU, counters."""
        self.counters.gets += 1
        try:
            check_object_name(name)
        except InvalidKeyError:
            self.counters.misses += 1
            return None
        self._reading[name] = self._reading.get(name, 0) + 1
        try:
            async with self._sem:
                size, got, result = await read()
        except FileNotFoundError:
            self._index_drop(name)
            self.counters.misses += 1
            return None
        except _Defective as exc:
            log.warning("kvstore disk: %s cannot be an object (%s); quarantined", printable_name(name), exc)
            self.counters.misses += 1
            await self.quarantine(name, f"{type(exc).__name__}: {exc}")
            return None
        except OSError as exc:
            log.warning("kvstore disk: read of %s failed: %s", printable_name(name), exc)
            self.counters.get_errors += 1
            self.counters.misses += 1
            return None
        finally:
            left = self._reading[name] - 1
            if left:
                self._reading[name] = left
            else:
                del self._reading[name]
        if name not in self._sizes:
            self._index_add(name, size)  # written by another process since our scan
        self.evictor.touch(name)
        self.counters.hits += 1
        self.counters.get_bytes += got
        return result

    async def retention_risks(self) -> list[str]:
        if self.capacity is None:
            return []
        return [
            f"{redact_url(self.url)} has a byte budget (capacity={self.capacity}) and evicts the least "
            "recently used objects to stay under it; open it without capacity="
        ]

    async def read_heads(self, names: Sequence[str], nbytes: int) -> list[memoryview | None]:
        return list(await asyncio.gather(*(self._head(n, nbytes) for n in names)))

    async def _head(self, name: str, nbytes: int) -> memoryview | None:
        try:
            check_object_name(name)
            fd, size = await _open_read(self.path_of(name), 1 << 62)
        except (InvalidKeyError, OSError, _Defective):
            return None
        buf = memoryview(bytearray(min(size, nbytes)))
        try:
            got = await _read_all(fd, buf)  # closes fd
        except OSError:
            return None
        return buf[:got]

    # ---- the rest -----------------------------------------------------------
    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        out = []
        for name in names:
            if name in self._sizes:
                out.append(True)
                continue
            try:
                check_object_name(name)
                st = await aiofiles.os.stat(self.path_of(name))
            except (InvalidKeyError, OSError):
                out.append(False)
                continue
            if not stat.S_ISREG(st.st_mode):
                out.append(False)
                continue
            self._index_add(name, st.st_size)
            out.append(True)
        return out

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        out = []
        for name in names:
            try:
                check_object_name(name)
            except InvalidKeyError:
                out.append(False)
                continue
            out.append(await self._remove(name))
        self.counters.deletes += sum(out)
        return out

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        problems: list[tuple[str, str]] = []
        entries = await asyncio.to_thread(partial(self._entries, problems=problems))
        # a problem is named by its object name, or by its path when the name is unknown
        self.unlisted.extend(p for p in problems if p[0].startswith(prefix) or os.path.isabs(p[0]))
        for name, st in sorted(entries, key=lambda e: e[0]):
            if name.startswith(prefix):
                yield ObjectInfo(name, st.st_size, st.st_mtime)

    async def quarantine(self, name: str, reason: str) -> None:
        self._index_drop(name)
        src = self.path_of(name)
        dst = self.quarantine_dir / f"{int(time.time() * 1000)}-{src.name}"
        try:
            await aiofiles.os.makedirs(self.quarantine_dir, exist_ok=True)  # removed while running?
            await aiofiles.os.replace(src, dst)
            await asyncio.to_thread(Path(f"{dst}.reason").write_text, f"{name}\n{reason}\n", "utf-8")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("kvstore disk: could not quarantine %s: %s", printable_name(name), exc)
            return
        self.counters.quarantined += 1

    def stats(self) -> BackendStats:
        return BackendStats(
            url=redact_url(self.url),
            objects=len(self._sizes),
            bytes=self._used,
            capacity_bytes=self.capacity,
            counters=self.counters,
            extra={"root": str(self.root), "fsync": self.fsync},
        )
