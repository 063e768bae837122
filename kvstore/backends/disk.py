"""Local-disk warm tier: ``file:///path?capacity=100GiB&fsync=true``.

Owns: the on-disk layout under one root directory, crash-safe writes, the quarantine
folder, and the use of the store's shared index (`kvstore.backends.disk_index`): one
byte budget and one LRU order for every process that opens the directory.  Must not
touch: frame parsing (the tier above validates objects and calls `quarantine`), tensors.

Layout::

    ROOT/index.sqlite3                    the shared index (SQLite, WAL); a cache of objects/
    ROOT/objects/<2 hex>/<escaped name>   one file per object, shard = digest of name (all 256 made at open)
    ROOT/objects/<2 hex>/.<pid>-<n>.tmp   a write in progress; removed at open if its writer is gone
    ROOT/quarantine/                      objects the tier found corrupt, with .reason

* A put reserves its bytes in the index first (evicting least recently used objects
  nobody is writing, across processes; none where that would not make room; the puts
  of one batch in one index transaction), then writes to a temp file beside its target
  (preallocated, one ``writev`` of header and payload; for a frame still unsealed, see
  `kvstore.frame.UnsealedFrame`, the payload in 2 MiB blocks each hashed just before it
  is written, then the header that seals it: one pass over cold memory instead of
  two, `kvstore.checksum.pwrite_crc32c`), fsyncs it (``fsync=false`` to
  skip) and renames it over its real name, so a crash never leaves a torn object under
  a real name, and two concurrent writers of one name each publish a whole object (the
  last rename wins).  On-disk bytes exceed ``capacity`` by at most the writes in flight.
  Same-directory temp files with ``fallocate`` measured ~20% faster than a separate
  temp folder (docs/benchmarks/core.md).
* Reads land in the caller's buffer (`alloc`) with ``preadv``, never a fresh
  ``bytes``; the file system is asked, never the index, so a file written by another
  process is always found.  Hits update the shared LRU order in batches (every
  ``FLUSH_S`` or ``FLUSH_N`` reads, and before this process's next reservation).
* Opening reads the index's totals; no directory walk on the calling thread.  A store
  never indexed (an older kvstore) or whose index was lost or corrupt is indexed by one
  walk in the index thread; temp files of dead writers are swept in a thread of its own.
* Blocking calls run in aiofiles' executor or the index thread: one hop per write plus
  one index transaction per batch; one hop per read when this process knows the
  object's size (allocate, then open + ``preadv`` + close), else two.  The exception is
  a lookup (`contains_now` on the caller's thread, `contains_many` on the loop): on a local file
  system the tier watches its shard folders (`kvstore.backends.disk_watch`: the kernel's
  file events keep the set of file names, so `contains_now` stats nothing, for up to
  1,024 names at once; ``watch=false`` to stat instead), else it stats a few names on the
  calling thread, and not for a while after stats keep taking over a millisecond
  (`_sizes_now`); on other file systems stats take a worker thread too.
* ``read_streamed`` (see `kvstore.backends.stream`) reads an object's head, lets the
  reader pick where the rest lands, and copies the payload there through a read-only
  mapping of the file, checksummed in the same pass (`kvstore.checksum.mapped_crc32c`;
  ~1.3x an unverified ``readinto`` of warm pages), or with ``pread`` block by block
  where mapping does not serve (``mmap=false``, no VPCLMULQDQ kernels, an object not all in
  the page cache, a file this process may not write).  A mapping is safe because a published file is never changed in place
  (writes rename a new file over it, deletes unlink it): a process that truncates a
  file under the root while it is read would make the reader fault; set ``mmap=false``
  where something other than kvstore rewrites these files, or on a network file system
  where another host's delete can withdraw an open file.  A batch is read by at most
  ``concurrency`` worker jobs, no more than the CPUs this process may run on (one hop
  each, not one per object), each taking the next object until none is left.
* ENOSPC, EACCES and files vanishing underneath are counted errors / misses.

File names are the object name percent-escaped (``/`` → ``%2F``, ``.`` → ``%2E``), so
they are reversible and never start with ``.``; the index can be rebuilt from a
directory walk.  A name whose escaped form is too long for a file name is stored as
``~`` + digest with a ``.name`` side file holding the name; a leading ``~`` of a short
name is escaped, so the two kinds of file name never meet.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import errno
import hashlib
import io
import itertools
import logging
import os
import re
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote, urlsplit

import aiofiles.os

from kvstore.backends.base import (
    MAX_OBJECT_OPTION,
    MEMORY_LOOKUP_MOST,
    Alloc,
    Backend,
    BackendStats,
    BackendUnavailableError,
    Capabilities,
    Defect,
    ObjectInfo,
    ReadsNow,
    Value,
    as_parts,
    bytearray_alloc,
    parts_len,
    redact_url,
)
from kvstore.backends.disk_index import FULL, INDEX_FILE, LEASE_S, OK, DiskIndex
from kvstore.backends.disk_watch import ObjectWatch
from kvstore.backends.inline_gate import InlineGate
from kvstore.backends.stream import StreamSink, wait_out
from kvstore.checksum import pwrite_crc32c
from kvstore.frame import UnsealedFrame
from kvstore.keys import InvalidKeyError, check_object_name, is_object_name, printable_name
from kvstore.options import option_bool, option_int, option_size, url_options
from kvstore.shared_jobs import run_shared

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_FILENAME = 250
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ids = itertools.count()
INLINE_STATS = 8  # contains_many of at most this many names stats them on the event loop
SLOW_STAT_S = 0.001  # stats slower than this a name send stats back to worker threads for a while (`InlineGate`)
SHARDS = tuple(f"{i:02x}" for i in range(256))  # every `shard_of`, made at open so the watch sees them all
# file systems whose stat is a local metadata lookup (not a network round trip)
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay", "bcachefs"})
# a warm read is a copy, bound by CPU: more reading jobs than cores only contend
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.~/%-]*")  # the characters chunk names are made of


def encode_filename(name: str) -> str:
    """The file name of object `name`: percent-escaped, or ``~`` + digest when too long.

    The two spaces are disjoint: an escaped name never starts with ``~`` (a leading
    ``~`` is written ``%7E``), so no name can be stored under another one's digest.
    """
    if _PLAIN_NAME.fullmatch(name):  # what `quote` would change here is '%' and '/' only
        enc = name.replace("%", "%25").replace("/", "%2F").replace(".", "%2E")
    else:
        enc = quote(name, safe="-_").replace(".", "%2E")
    if enc.startswith("~"):
        enc = "%7E" + enc[1:]
    if len(enc) <= MAX_FILENAME:
        return enc
    return "~" + hashlib.blake2b(name.encode(), digest_size=20).hexdigest()


def _watched_name(name: str) -> str:
    """The file name `ObjectWatch` knows `name` by; "." (never kept) for a string no file
    can be named after.  No other check is needed: the escaping is one to one, and a
    name that is not an object's was never written."""
    try:
        return encode_filename(name)
    except UnicodeError:  # a lone surrogate
        return "."


def shard_of(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=1).hexdigest()


def _write_all(fd: int, parts: list[memoryview]) -> None:
    pending = [p for p in parts if p.nbytes]
    while pending:
        n = os.writev(fd, pending[:IOV_MAX])
        while n:
            if n >= pending[0].nbytes:
                n -= pending.pop(0).nbytes
            else:
                pending[0] = pending[0][n:]
                n = 0


def _write_sealing(fd: int, frame: UnsealedFrame) -> None:
    """The payload of `frame`, each block hashed just before it is written (one pass over
    it: `pwrite_crc32c`), then the header that checksum seals, at the front."""
    offset, csum = frame.head_len, 0
    for part in frame.payload:
        csum = pwrite_crc32c(fd, part, offset, csum)
        offset += part.nbytes
    head = frame.seal(csum)
    done = 0
    while done < head.nbytes:
        n = os.pwrite(fd, head[done:], done)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite of a frame header wrote nothing")
        done += n


class _Abandoned(Exception):
    """The caller stopped waiting for a write before it was published: not published (its
    buffers may have been reused under it)."""


@aiofiles.os.wrap
def _write_object(
    path: Path,
    name: str,
    parts: list[memoryview],
    size: int,
    fsync: bool,
    unsealed: UnsealedFrame | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Publish one object atomically: temp file beside it, fallocate, writev, fsync, rename.

    An `unsealed` frame (whose parts `parts` are) is hashed as it is written when this
    write can claim it, else written once sealed.  The shard directory (and the store's,
    if it was removed while running) is made here if it is missing.  With `stop` set by
    the time the bytes are written, the file is removed unpublished (`_Abandoned`): the
    bytes written were read from buffers the caller may have reused meanwhile.
    """
    tmp = f"{os.path.dirname(path)}/.{os.getpid()}-{next(_ids)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:  # the shard's directory is gone (the store's removed while running)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, before any byte is written
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        if unsealed is not None and unsealed.claim():
            try:
                _write_sealing(fd, unsealed)
            except BaseException:
                unsealed.release()
                raise
        else:
            if unsealed is not None:
                unsealed.ensure_sealed()  # another write of it hashes it: the header, once it is there
            _write_all(fd, parts)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        if stop is not None and stop.is_set():
            raise _Abandoned()
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


def _sync_directories(dirs: Iterable[Path]) -> None:
    """fsync each directory, in order (children before their parents)."""
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sync_files(paths: Iterable[Path]) -> None:
    """fsync each regular file that is there (its data and size); one gone since is
    skipped (whoever deleted it decided; the caller checks what is still there)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | _CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Defective(Exception):
    """What is at an object's path cannot be that object (a directory or other non-file);
    the reader quarantines it and serves a miss."""


class _TooLarge(Exception):
    """A file larger than this reader's ``max_object_size``: not read into memory, a
    counted miss (``rejected``), left in place: another process may have written it
    under a larger limit."""


def local_file_system(path: Path) -> bool:
    """Whether `path` lies on a local file system (`LOCAL_FILE_SYSTEMS`, by the longest
    mount point in ``/proc/mounts`` above it); False where that cannot be told."""
    try:
        target = os.path.realpath(path)
        best, fstype = "", ""
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[2]
    except OSError:
        return False
    return fstype in LOCAL_FILE_SYSTEMS


def _check_stat(st: os.stat_result, max_size: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Defective("not a regular file")
    if st.st_size > max_size:
        raise _TooLarge(st.st_size)


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


def _stream_one(path: Path, sink: StreamSink, max_size: int, mapped: bool) -> tuple[int, int, object]:
    """(object size, bytes read, the sink's verdict); see `kvstore.backends.stream`.
    ``mapped``: the payload may be copied through a mapping of the file."""
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
            # mapped only within the size fstat saw: published files never change in place
            got += sink.feed_pread(fd, dst, offset, mapped=mapped and offset + len(dst) <= size)
        return size, got, sink.finish()
    finally:
        os.close(fd)


def _stale_temp(entry: os.DirEntry[str]) -> bool:
    """A temp file no live writer will finish: its writer (``.<pid>-<n>.tmp``) is not a
    running process here, or it is older than a write lease.  Other processes' writes in
    flight are left alone."""
    try:
        pid = int(entry.name[1:].split("-", 1)[0])
    except ValueError:
        pid = 0
    if pid and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
    try:
        return time.time() - entry.stat().st_mtime > LEASE_S
    except OSError:
        return False


MAX_SIZE_CACHE = 1 << 18  # object sizes this process remembers (reads allocate, then read: one hop)
FLUSH_S = 0.05  # batched index updates from reads wait at most this long...
FLUSH_N = 256  # ...or until this many have gathered


class DiskBackend(Backend):
    schemes = ("file",)
    capabilities = Capabilities(
        streamed_reads=True, cancels_cleanly=True, ranged_reads=True, enforces_capacity=True, seals_frames=True
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        fsync: bool = True,
        concurrency: int = 4,
        url: str | None = None,
        max_object: int | str | None = None,
        mmap: bool = True,
        watch: bool = True,
    ) -> None:
        super().__init__(url or Path(root).absolute().as_uri())
        self.set_max_object(max_object)
        option_int("concurrency", concurrency)
        if capacity is not None:
            option_size("capacity", capacity)
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self._objects = str(self.objects_dir)
        # stats on the loop or the caller's thread only where one is a local lookup, and
        # not for a while after one was slow (`_sizes_now`)
        self._inline = InlineGate(closed=not local_file_system(self.root))
        self._watch: ObjectWatch | None = None  # the files under objects/, kept by the kernel's events
        self._clock = time.perf_counter  # monotonic, and fine enough to time a stat
        self._ready_now = False  # the index is open (`_opened` done), as a plain flag
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.objects_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.fsync = fsync
        self._sizes: dict[str, int] = {}  # sizes this process has seen (a cache, not the truth)
        self._reading: dict[str, int] = {}
        self.concurrency = concurrency
        self.mmap = mmap
        self._sem = asyncio.Semaphore(concurrency)
        self._write_done = asyncio.Condition()
        self._abandoned: set[asyncio.Future[list[bool]]] = set()  # writes whose callers stopped waiting
        self._asks: list[tuple[str, int, str, asyncio.Future[str]]] = []  # reservations to send (`_ask_index`)
        self._touches: dict[str, float] = {}
        self._published: list[tuple[str, int, str]] = []
        self._adopt: set[str] = set()
        self._missing: set[str] = set()
        self._flush_handle: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Future[None]] = set()
        self._closed = False
        self.index = DiskIndex(self.root / INDEX_FILE, self._walk, self._unlink_object, self._file_size)
        self.index.connect()  # opens the database and reads its totals: no directory walk
        self._opened = self.index.submit(self.index.open, capacity)  # a walk only if never indexed
        self._swept = concurrent.futures.Future[None]()
        threading.Thread(target=self._sweep, name="kvstore-disk-sweep", daemon=True).start()
        self._watched = concurrent.futures.Future[None]()  # the watch's first listing is done (or none comes)
        if local_file_system(self.root) and watch:
            self._start_watch()
        if self._watch is None:  # no watch, so no thread to say it listed
            self._watched.set_result(None)

    async def ready(self) -> None:
        """Wait until the index is built (a walk, for a store never indexed) and leftover
        temp files of dead writers are removed; every operation waits for the first part."""
        await asyncio.wrap_future(self._opened)
        await asyncio.wrap_future(self._swept)

    async def watching(self) -> bool:
        """Wait for the watch's first listing; whether lookups are answered from it."""
        await asyncio.wrap_future(self._watched)
        return self._watching()

    def _start_watch(self) -> None:
        """Make every shard folder and watch them (`ObjectWatch`); a thread of the watch's
        own lists them and reads events (it holds the watch, not this backend, so a
        backend dropped unclosed is collected and its watch closed)."""
        try:
            folders = [self.objects_dir / s for s in SHARDS]
            for f in folders:
                f.mkdir(parents=True, exist_ok=True)
            watch = ObjectWatch.open((str(f) for f in folders), guards=(str(self.root), self._objects))
        except OSError as exc:
            log.info("kvstore disk: cannot watch %s for new files (%s); lookups stat each file", self.root, exc)
            return
        if watch is None:
            return
        self._watch = watch
        weakref.finalize(self, watch.close)
        done, root, objects = self._watched, self.root, self._objects  # not `self`: see above

        def listed() -> None:
            if not done.done():
                done.set_result(None)

        def keep() -> None:
            watch.keep(objects, listed)
            if watch.failed not in ("closed", None):
                log.info("kvstore disk: stopped watching %s: %s; lookups stat each file", root, watch.failed)

        threading.Thread(target=keep, name="kvstore-disk-watch", daemon=True).start()

    async def _open(self) -> None:
        if not self._opened.done():
            await asyncio.wrap_future(self._opened)

    @classmethod
    def open_existing(cls, url: str) -> DiskBackend:
        """Open a store that must already be there (read-only commands): a path that does not
        exist is `BackendUnavailableError`, and nothing is created (no shard folders: such
        commands list, they do not look names up, so they need no watch)."""
        root = Path(unquote(urlsplit(url).path))
        if not (root / "objects").is_dir():
            what = "does not exist" if not root.exists() else "is not a kvstore disk store (no objects/)"
            raise BackendUnavailableError(f"{redact_url(url)}: {root} {what}; check the path")
        return cls.from_url(url, watch=False)

    @classmethod
    def from_url(cls, url: str, *, watch: bool | None = None) -> DiskBackend:
        """Open from a URL; `watch` overrides the URL's ``watch`` option."""
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"{redact_url(url)!r}: file URLs name a local path: file:///abs/path or file://localhost/abs/path"
            )
        if not parts.path:
            raise ValueError(f"{redact_url(url)!r} has no path; write file:///var/cache/kvstore")
        opts = url_options(url, {"capacity", "fsync", "concurrency", "mmap", "watch", MAX_OBJECT_OPTION})
        return cls(
            unquote(parts.path),
            capacity=option_size("capacity", opts.get("capacity")),
            fsync=option_bool("fsync", opts.get("fsync"), True),
            concurrency=option_int("concurrency", opts.get("concurrency", 4)),
            url=url,
            max_object=opts.get(MAX_OBJECT_OPTION),
            mmap=option_bool("mmap", opts.get("mmap"), True),
            watch=option_bool("watch", opts.get("watch"), True) if watch is None else watch,
        )

    # ---- the files ------------------------------------------------------------
    def _entries(
        self, *, clean: bool = False, problems: list[tuple[str, str]] | None = None
    ) -> list[tuple[str, os.stat_result]]:
        """(name, stat) of every stored object; with `clean`, remove unfinished writes of
        writers that are gone.

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
                    if clean and _stale_temp(entry):
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

    def _walk(self) -> list[tuple[str, int, float]]:
        """For the index: every object as (name, size, mtime), unfinished writes removed."""
        return [(name, st.st_size, st.st_mtime) for name, st in self._entries(clean=True)]

    def _sweep(self) -> None:
        """In a thread of its own at open: remove temp files that dead writers left."""
        try:
            for shard in os.scandir(self.objects_dir):
                if not shard.is_dir():
                    continue
                for entry in os.scandir(shard.path):
                    if entry.name.startswith(".") and _stale_temp(entry):
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
        except OSError:
            pass
        finally:
            self._swept.set_result(None)

    def _unlink_object(self, name: str) -> bool:
        """For the index (eviction): True if `name`'s file is gone now, False if it cannot be removed."""
        path = self.path_of(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("kvstore disk: could not remove %s: %s", printable_name(name), exc)
            self.counters.delete_errors += 1
            return False
        if path.name.startswith("~"):
            try:
                os.unlink(f"{path}.name")
            except OSError:
                pass
        return True

    def _file_size(self, name: str) -> int | None:
        try:  # a string path: building a `Path` (or `os.path.join`) took as long as the stat
            st = os.stat(f"{self._objects}/{shard_of(name)}/{encode_filename(name)}")
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

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

    def _remember(self, name: str, size: int) -> None:
        if name not in self._sizes and len(self._sizes) >= MAX_SIZE_CACHE:
            for old in list(itertools.islice(self._sizes, MAX_SIZE_CACHE // 2)):
                del self._sizes[old]
        self._sizes[name] = size

    def path_of(self, name: str) -> Path:
        return self.objects_dir / shard_of(name) / encode_filename(name)

    # ---- batched index updates ------------------------------------------------
    async def _index_call(self, fn: Callable[..., object], *args: object) -> None:
        """Bookkeeping that may fail without failing the operation (the files are the truth)."""
        try:
            await self.index.run(fn, *args)
        except (sqlite3.Error, OSError, RuntimeError) as exc:  # (RuntimeError: the index closed)
            log.warning("kvstore disk: index %s update failed: %s", self.index.path, exc)

    def _later(self) -> None:
        """Flush what reads found soon: after FLUSH_S, or now if FLUSH_N have gathered."""
        n = len(self._touches) + len(self._published) + len(self._adopt) + len(self._missing)
        if n >= FLUSH_N:
            self._flush_now()
        elif self._flush_handle is None and not self._closed:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush_now)

    def _take(self) -> tuple[dict[str, float], list[tuple[str, int, str]]]:
        touches, published = self._touches, self._published
        self._touches, self._published = {}, []
        return touches, published

    def _keep(self, touches: dict[str, float], published: list[tuple[str, int, str]]) -> None:
        """Touches and publishes taken for a transaction that did not happen, put back
        for the next (a published row left leased would hold its bytes until its lease
        lapses, and writes elsewhere would wait for it)."""
        if not self._closed:
            self._touches = {**touches, **self._touches}
            self._published = published + self._published

    def _flush_now(self) -> asyncio.Future[None] | None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        touches, published = self._take()
        adopt, missing = self._adopt, self._missing
        self._adopt, self._missing = set(), set()
        if not (touches or published or adopt or missing):
            return None
        fut = asyncio.wrap_future(self.index.submit(self.index.flush, touches, published, adopt, missing))
        self._flushing.add(fut)
        fut.add_done_callback(partial(self._flushed, touches, published))
        return fut

    def _flushed(
        self, touches: dict[str, float], published: list[tuple[str, int, str]], fut: asyncio.Future[None]
    ) -> None:
        self._flushing.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("kvstore disk: index update failed: %s", fut.exception())
            self._keep(touches, published)

    async def flush(self) -> None:
        """Write what this process's reads found into the shared index now."""
        await self._open()
        self._flush_now()
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)

    async def retention_risks(self) -> builtins.list[str]:
        """Besides a byte budget: writes that are not synced (``fsync=false``)."""
        risks = await super().retention_risks()
        if not self.fsync:
            risks.append(
                f"{redact_url(self.url)} does not sync what it writes (fsync=false), so a crash or power "
                "loss can lose objects after their sources are deleted; drop fsync=false from the URL"
            )
        return risks

    async def make_durable(self, names: Sequence[str] | None = None) -> None:
        """Sync the files of `names` (an earlier run with ``fsync=false`` may have left
        them in the page cache only: a file written here with ``fsync=true`` was synced
        before its rename, so syncing it again costs little), then every shard
        directory, the objects directory, the store's and the one above it: a rename is
        on the disk only once its directory is, and a directory made since it was last
        synced only once its parent is. Every shard, not only those this process wrote
        into: an earlier run's objects a rerun found in place count as copied too."""
        if not self.fsync:
            return
        if names:
            files: list[Path] = []
            for name in names:
                path = self.path_of(name)
                files.append(path)
                if path.name.startswith("~"):  # a long name's side file names it
                    files.append(Path(f"{path}.name"))
            await asyncio.to_thread(_sync_files, files)
        shards = [self.objects_dir / s for s in SHARDS]
        dirs = [*(d for d in shards if d.is_dir()), self.objects_dir, self.root]
        await asyncio.to_thread(_sync_directories, dirs)
        try:  # the store's own entry: best effort (the directory above may not be ours to open)
            await asyncio.to_thread(_sync_directories, [self.root.parent])
        except OSError as exc:
            log.debug("kvstore disk: cannot sync %s: %s", self.root.parent, exc)

    async def close(self) -> None:
        if self._closed:
            return
        if self._abandoned:  # writes whose callers stopped waiting: their bookkeeping first
            await asyncio.wait(set(self._abandoned), timeout=30)
        await self.flush()
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        await asyncio.to_thread(self.index.close)

    # ---- put ----------------------------------------------------------------
    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        """Each object written beside its place and renamed into it, on worker threads.  A
        caller that stops waiting (a deadline) returns at once; the writes it began are
        not published (`_Abandoned`: their worker threads may go on reading its buffers,
        which it may reuse, so what they wrote could be torn under a checksum computed
        as it was written), and writes not yet begun do not begin."""
        stop = threading.Event()
        work = asyncio.gather(*(self._put_one(n, v, stop) for n, v in items))
        try:
            return list(await asyncio.shield(work))
        except asyncio.CancelledError:
            stop.set()
            self._abandoned.add(work)  # (its bookkeeping ends in the background; `close` waits)
            work.add_done_callback(self._abandoned.discard)
            raise

    async def _put_one(self, name: str, value: Value, stop: threading.Event | None = None) -> bool:
        try:
            check_object_name(name)
        except InvalidKeyError as exc:
            log.warning("kvstore disk: refusing object name: %s", exc)
            self.counters.put_errors += 1
            return False
        unsealed = value if isinstance(value, UnsealedFrame) else None
        parts = as_parts(value)
        size = parts_len(parts)
        if (self.capacity is not None and size > self.capacity) or self.too_large(name, size):
            self.counters.rejected += 1
            return False
        await self._open()
        async with self._sem:
            writer = f"{os.getpid()}-{next(_ids)}"
            try:
                reserved = await self._reserve(name, size, writer)
            except (sqlite3.Error, OSError, RuntimeError) as exc:  # (RuntimeError: closed)
                log.error("kvstore disk: index %s cannot take a write: %s", self.index.path, exc)
                self.counters.put_errors += 1
                return False
            if not reserved:
                self.counters.rejected += 1
                return False
            if stop is not None and stop.is_set():  # the caller stopped waiting before it began
                await self._index_call(self.index.unreserve, name, writer)
                return False
            try:
                await _write_object(self.path_of(name), name, parts, size, self.fsync, unsealed, stop)
            except _Abandoned:
                await self._index_call(self.index.unreserve, name, writer)
                return False
            except OSError as exc:
                self.counters.put_errors += 1
                fatal = exc.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS)
                log.log(
                    logging.ERROR if fatal else logging.WARNING,
                    "kvstore disk: write of %s failed: %s",
                    name,
                    exc,
                )
                await self._index_call(self.index.unreserve, name, writer)
                return False
            finally:
                async with self._write_done:
                    self._write_done.notify_all()
        self._published.append((name, size, writer))  # the row already counts it: publishing can wait
        self._later()
        self._remember(name, size)
        self.counters.puts += 1
        self.counters.put_bytes += size
        return True

    async def _reserve(self, name: str, size: int, writer: str) -> bool:
        """Reserve `size` bytes for `name` in the shared index, evicting the least recently
        used objects nobody is writing (told to `on_evict`); False if they cannot fit (the
        budget is kept)."""
        deadline = time.monotonic() + LEASE_S
        while True:
            ask = self._ask_index(name, size, writer)
            try:
                status = await ask
            except asyncio.CancelledError:
                # answered OK, but this task was cancelled before it went on: no write
                # comes, so the bytes go back (cancelled before the answer:
                # `_answer_asks` gives them back)
                if ask.done() and not ask.cancelled() and ask.exception() is None and ask.result() == OK:
                    self._release(name, writer)
                raise
            if status == OK:
                return True
            if status == FULL or time.monotonic() > deadline:
                return False
            async with self._write_done:  # a write here or elsewhere finishes, then ask again
                try:
                    await asyncio.wait_for(self._write_done.wait(), 0.02)
                except asyncio.TimeoutError:
                    pass

    def _ask_index(self, name: str, size: int, writer: str) -> asyncio.Future[str]:
        """One reservation's status (`DiskIndex.reserve`), sent with every other asked in
        the same turn of the loop in one index transaction (`DiskIndex.reserve_many`): a
        batch's writes reserve with one hop to the index thread, not one each in turn.
        The objects evicted for it are told to `on_evict` as the answer comes."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        self._asks.append((name, size, writer, fut))
        if len(self._asks) == 1:
            loop.call_soon(self._send_asks)
        return fut

    def _send_asks(self) -> None:
        asks, self._asks = self._asks, []
        touches, published = self._take()
        try:
            job = self.index.submit(
                self.index.reserve_many,
                [(name, size, writer) for name, size, writer, _ in asks],
                frozenset(self._reading),
                self.capacity,
                touches,
                published,
            )
        except BaseException as exc:  # (closed: the index takes no more jobs) every ask fails with it
            self._keep(touches, published)  # (for the next transaction)
            for *_, fut in asks:
                if not fut.done():
                    fut.set_exception(exc)
            return
        asyncio.wrap_future(job).add_done_callback(partial(self._answer_asks, asks, touches, published))

    def _answer_asks(
        self,
        asks: list[tuple[str, int, str, asyncio.Future[str]]],
        touches: dict[str, float],
        published: list[tuple[str, int, str]],
        done: asyncio.Future[list[tuple[str, list[str]]]],
    ) -> None:
        exc = asyncio.CancelledError() if done.cancelled() else done.exception()
        answers = done.result() if exc is None else [None] * len(asks)
        if exc is not None:  # the transaction did not commit: its touches and publishes go with the next
            self._keep(touches, published)
        for (name, _, writer, fut), answer in zip(asks, answers):
            if answer is not None:
                status, evicted = answer
                for victim in evicted:
                    self._sizes.pop(victim, None)
                self.evicted(evicted)
                if fut.done() and status == OK:  # nobody waits for it any more: no write comes
                    self._release(name, writer)
                elif not fut.done():
                    fut.set_result(status)
            elif not fut.done():
                assert exc is not None
                fut.set_exception(exc)

    def _release(self, name: str, writer: str) -> None:
        """Give back a reservation no write will use (best effort: its lease lapses anyway)."""
        try:
            job = self.index.submit(self.index.unreserve, name, writer)
        except RuntimeError:  # the index is closed: the lease lapses
            return
        job.add_done_callback(self._unreserved)

    @staticmethod
    def _unreserved(fut: concurrent.futures.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("kvstore disk: index reservation could not be released: %s", fut.exception())

    async def _remove(self, name: str) -> bool | None:
        """True if the object existed and is gone now; False if it was not there; None if
        it could not be removed (counted in ``delete_errors``; it stays indexed)."""
        path = self.path_of(name)
        try:
            await aiofiles.os.remove(path)
        except FileNotFoundError:  # gone already (another process deleted it)
            return False
        except OSError as exc:
            log.error("kvstore disk: could not remove %s: %s", printable_name(name), exc)
            self.counters.delete_errors += 1
            return None
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
        """Each object streamed into the sink ``open_sink(name)`` gives; the sinks'
        verdicts, None for a miss or an I/O error.

        The objects are read by at most ``concurrency`` worker jobs (and no more than
        this process has CPUs: a read of warm pages is a copy), each taking the next
        object from the batch until none is left (`kvstore.shared_jobs`): a batch costs
        that many executor hops and loop wake-ups, not one per object (each hop is a
        thread hand-off; on a machine with few cores the workers' copies keep every core
        busy, and a Python step waiting for a core or the GIL between reads was most of
        the time a batch spent above the copies), and no job idles while another still
        has several objects to read.  Cancelled, it reads no object it had not begun.
        """
        sinks = [open_sink(n) for n in names]
        out: list[object | None] = [None] * len(names)
        todo = [k for k, n in enumerate(names) if self._may_read(n)]
        if not todo:
            return out
        await self._open()
        for k in todo:
            self._start_reading(names[k])
        try:
            results = await run_shared(
                self._stream_step,
                [(self.path_of(names[k]), sinks[k]) for k in todo],
                min(self.concurrency, _CPUS),
                self._run_job,
            )
            # the bookkeeping (a quarantine, the index) is not cut short by a cancellation
            settling = asyncio.ensure_future(self._settle(names, todo, results, out))
            try:
                fault = await asyncio.shield(settling)
            except asyncio.CancelledError:
                await wait_out(settling)
                raise
        finally:
            for k in todo:
                self._unreading(names[k])
        if fault is not None:
            raise fault
        return out

    async def _settle(
        self, names: Sequence[str], todo: list[int], results: Sequence[object], out: list[object | None]
    ) -> Exception | None:
        """Each read's outcome on the books; the first fault of a reader's sink (not of an
        object), raised by the caller once all are settled."""
        fault: Exception | None = None
        for k, r in zip(todo, results):
            if isinstance(r, tuple):
                size, got, out[k] = r
                self._read_done(names[k], size, got)
            elif isinstance(r, (OSError, _Defective, _TooLarge)):
                await self._read_failed(names[k], r)
            elif isinstance(r, Exception):
                self.counters.misses += 1
                fault = fault or r
        return fault

    def reader_now(self) -> ReadsNow | None:
        """One object's streamed read as a blocking step for a thread of the caller's
        (`kvstore.tiered.direct`: reads whose whole path stays off the event loop), or
        None when that cannot be done now (the index not open yet, or the backend
        closed).  A step returns (object size, bytes read, the sink's verdict) or raises
        (`OSError`, a defect, a name that cannot be an object's): it leaves no trace on
        the books, the caller reports the objects it found with `read_off_loop`, and
        reads anything else again through `read_streamed`, which counts and settles it."""
        opened = self._opened
        if self._closed or not opened.done() or opened.exception() is not None:
            return None
        return ReadsNow(self._step_now, self.concurrency)

    def _step_now(self, name: str, sink: StreamSink) -> tuple[int, int, object]:
        check_object_name(name)
        return _stream_one(self.path_of(name), sink, self.max_object_bytes, self.mmap)

    def read_off_loop(self, names: Sequence[str], sizes: Sequence[int], got: Sequence[int]) -> None:
        """On the loop: objects `reader_now`'s steps found (their sizes, bytes read) go on
        the books as `read_streamed`'s reads do (counters, sizes, LRU touches)."""
        for name, size, n in zip(names, sizes, got):
            self.counters.gets += 1
            self._read_done(name, size, n)

    def _stream_step(self, item: tuple[Path, StreamSink]) -> tuple[int, int, object]:
        return _stream_one(item[0], item[1], self.max_object_bytes, self.mmap)

    async def _run_job(self, job: Callable[[], None]) -> None:
        async with self._sem:
            await asyncio.get_running_loop().run_in_executor(None, job)

    def _may_read(self, name: str) -> bool:
        """Count a read of `name`; False (a counted miss) if it cannot be an object name."""
        self.counters.gets += 1
        try:
            check_object_name(name)
        except InvalidKeyError:
            self.counters.misses += 1
            return False
        return True

    def _start_reading(self, name: str) -> None:
        """Mark `name` as being read (the index never evicts it meanwhile)."""
        self._reading[name] = self._reading.get(name, 0) + 1

    def _unreading(self, name: str) -> None:
        left = self._reading[name] - 1
        if left:
            self._reading[name] = left
        else:
            del self._reading[name]

    async def _read_failed(self, name: str, exc: BaseException) -> None:
        """The bookkeeping of a read that found no usable object (a counted miss)."""
        self.counters.misses += 1
        if isinstance(exc, FileNotFoundError):
            if self._sizes.pop(name, None) is not None:  # it was here: its row goes now
                touches, published = self._take()
                await self._index_call(self.index.flush, touches, published, set(), {name})
            else:  # maybe a row without a file: checked with the next batch
                self._missing.add(name)
                self._later()
        elif isinstance(exc, _TooLarge):  # maybe written under a larger limit: left where it is
            self.too_large(name, int(exc.args[0]))  # (logged: raise max_object_size if it is real)
            self.counters.rejected += 1
        elif isinstance(exc, _Defective):
            log.warning("kvstore disk: %s cannot be an object (%s); quarantined", printable_name(name), exc)
            await self.quarantine(name, f"{type(exc).__name__}: {exc}")
        else:
            log.warning("kvstore disk: read of %s failed: %s", printable_name(name), exc)
            self.counters.get_errors += 1

    def _read_done(self, name: str, size: int, got: int) -> None:
        """The bookkeeping of a read that found the object: size, LRU touch, counters."""
        self._remember(name, size)
        self._touches[name] = time.time()  # batched: the shared LRU order learns it soon
        self._later()
        self.counters.hits += 1
        self.counters.get_bytes += got

    async def _tracked_read(self, name: str, read: Callable[[], Awaitable[tuple[int, int, T]]]) -> T | None:
        """Run `read` -> (object size, bytes read, result) for one object with the
        bookkeeping every read shares: name check, reader count, index, LRU, counters."""
        if not self._may_read(name):
            return None
        await self._open()
        self._start_reading(name)
        try:
            async with self._sem:
                size, got, result = await read()
        except (OSError, _Defective, _TooLarge) as exc:
            await self._read_failed(name, exc)
            return None
        finally:
            self._unreading(name)
        self._read_done(name, size, got)
        return result

    async def read_heads(self, names: Sequence[str], nbytes: int) -> list[memoryview | None]:
        return list(await asyncio.gather(*(self._head(n, nbytes) for n in names)))

    async def _head(self, name: str, nbytes: int) -> memoryview | None:
        try:
            check_object_name(name)
            fd, size = await _open_read(self.path_of(name), 1 << 62)
        except (InvalidKeyError, OSError, _Defective, _TooLarge):
            return None
        buf = memoryview(bytearray(min(size, nbytes)))
        try:
            got = await _read_all(fd, buf)  # closes fd
        except OSError:
            return None
        return buf[:got]

    # ---- the rest -----------------------------------------------------------
    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Asks the file system (the truth); files the index does not know are adopted with
        the next batch.  A few names are looked up on the loop itself (a `stat` of a local
        file is a few microseconds, a hop to a worker thread and back ~0.1 ms on a 2-core
        machine, and a lookup that misses asks about one name), a larger batch in one hop."""
        valid = [n for n in names if is_object_name(n)]
        await self._open()
        found = self._sizes_now(valid)
        if found is None:
            found = await asyncio.to_thread(lambda: [self._file_size(n) for n in valid])
        sizes = dict(zip(valid, found))
        out = []
        for name in names:
            size = sizes.get(name)
            if size is None:
                out.append(False)
                continue
            if name not in self._sizes:
                self._adopt.add(name)
                self._remember(name, size)
            out.append(True)
        if self._adopt:
            self._later()
        return out

    def contains_now(self, names: Sequence[str]) -> list[bool] | None:
        """Asked of the watch (`ObjectWatch`: the kernel's file events, no `stat`) once it
        answers, else a `stat` per name on the caller's thread; no bookkeeping
        (`contains_many` adopts what it finds); None before the store is open and where
        `_sizes_now` says no.  A name that is not an object's is never held."""
        if not self._ready_now:
            if not self._opened.done():  # a concurrent future: its lock is not free
                return None
            self._ready_now = True
        watch = self._watch
        if watch is not None:
            held = watch.held([_watched_name(n) for n in names])
            if held is not None:
                return held
        valid = [n for n in names if is_object_name(n)]
        sizes = self._sizes_now(valid)
        if sizes is None:
            return None
        if len(valid) == len(names):
            return [size is not None for size in sizes]
        found = {n for n, size in zip(valid, sizes) if size is not None}
        return [n in found for n in names]

    def contains_now_batch(self) -> int:
        return MEMORY_LOOKUP_MOST if self._watching() else INLINE_STATS

    def contains_now_most(self) -> int:
        return MEMORY_LOOKUP_MOST if self._watching() else super().contains_now_most()

    def _watching(self) -> bool:
        watch = self._watch
        return watch is not None and watch.ready

    def _sizes_now(self, names: list[str]) -> list[int | None] | None:
        """`_file_size` of each name on this thread, or None (ask a worker thread) for a
        batch over `INLINE_STATS`, a file system that is not local, or while backing off
        from slow stats (over `SLOW_STAT_S` a name, twice in a row: `InlineGate`): a stat
        that waits on a server or a cold disk must not hold the event loop or LMCache's
        thread."""
        if not names:
            return []
        t0 = self._clock()
        if len(names) > INLINE_STATS or not self._inline.open(t0):
            return None
        sizes = [self._file_size(n) for n in names]
        t1 = self._clock()
        backoff = self._inline.answered(t0, t1, SLOW_STAT_S * len(names))
        if backoff:
            log.info(
                "kvstore disk: stats under %s are slow (%.1f ms for %d); lookups stat on worker threads for %.0f s",
                self.root, (t1 - t0) * 1e3, len(names), backoff,
            )
        return sizes

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        await self._open()
        out = []
        gone = []
        for name in names:
            try:
                check_object_name(name)
            except InvalidKeyError:
                out.append(False)
                continue
            removed = await self._remove(name)
            out.append(bool(removed))
            if removed is not None:
                gone.append(name)
                self._sizes.pop(name, None)
        if gone:
            await self._index_call(self.index.drop, gone)
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

    async def quarantine(self, name: str, reason: str, found: Defect | None = None) -> bool:
        """Move the object's file into ``quarantine/`` (with a ``.reason`` beside it).

        With ``found.read``, only the file that holds exactly those bytes: the file is
        compared where it is (through an open descriptor), then renamed, and the renamed
        file is checked to be the one compared (a file another process renamed into
        place in between is put back, unless a newer one is there by then).  With
        ``found.absent``, only while a read still finds nothing.  With ``found.since``
        (when the read that found it began), only a file whose change time is older, by
        `CTIME_MARGIN_S` for the kernel's coarse clock: a file renamed into place since
        (a rename sets its change time) is not the one that read found defective.
        """
        await self._open()
        if found is not None and found.absent and not await self._still(name, found):
            return False
        src = self.path_of(name)
        # unique across processes quarantining the same name in the same millisecond
        # (the name's start only: the .reason file beside it holds the whole name)
        dst = self.quarantine_dir / f"{int(time.time() * 1000)}-{os.getpid()}-{next(_QUARANTINE_IDS)}-{src.name[:160]}"
        try:
            moved = await asyncio.to_thread(_move_aside, src, dst, self.quarantine_dir, found)
        except FileNotFoundError:
            self._sizes.pop(name, None)
            await self._index_call(self.index.drop, [name])
            return False
        except OSError as exc:
            log.warning("kvstore disk: could not quarantine %s: %s", printable_name(name), exc)
            return False
        if not moved:
            return False
        self._sizes.pop(name, None)
        try:
            await asyncio.to_thread(Path(f"{dst}.reason").write_text, f"{name}\n{reason}\n", "utf-8")
        except OSError as exc:
            log.warning("kvstore disk: could not write why %s was quarantined: %s", printable_name(name), exc)
        await self._index_call(self.index.drop, [name])
        self.counters.quarantined += 1
        return True

    def stats(self) -> BackendStats:
        """Objects and bytes are the whole store's (every process's), as of this process's
        last index transaction."""
        return BackendStats(
            url=redact_url(self.url),
            objects=self.index.objects,
            bytes=self.index.bytes,
            capacity_bytes=self.capacity,
            counters=self.counters,
            extra={
                "root": str(self.root),
                "fsync": self.fsync,
                "index": str(self.index.path),
                "indexing": not self._opened.done(),
                "lookups": self._lookup_source(),
            },
        )

    def _lookup_source(self) -> str:
        """How `contains_now` finds files now: from the watch, or by `stat` and why."""
        watch = self._watch
        if watch is None:
            return "stat"
        if watch.ready:
            return "file events"
        return f"stat ({watch.failed})" if watch.failed else "stat (listing the folders)"



_QUARANTINE_IDS = itertools.count()
CTIME_MARGIN_S = 0.05  # file change times come from a coarse clock (a few ms behind time.time())


def _move_aside(src: Path, dst: Path, quarantine_dir: Path, found: Defect | None) -> bool:
    """Rename `src` to `dst`; with `found`, only the file that is still what was found
    (see `DiskBackend.quarantine`).  True when a file was moved aside and stays there."""
    os.makedirs(quarantine_dir, exist_ok=True)  # (removed while running?)
    if found is None or (found.read is None and found.since is None):
        os.replace(src, dst)
        return True
    with open(src, "rb") as f:
        st = os.fstat(f.fileno())
        if found.since is not None and st.st_ctime_ns > (found.since - CTIME_MARGIN_S) * 1e9:
            return False
        if found.read is not None and not _holds(f, st.st_size, found.read):
            return False
        os.replace(src, dst)
    moved = os.lstat(dst)
    if (moved.st_dev, moved.st_ino) == (st.st_dev, st.st_ino):
        return True  # published files never change in place: this is the file compared
    try:  # another process renamed a new file into place between the compare and the rename
        _put_back(dst, src)
    except OSError as exc:
        log.error("kvstore disk: a good file moved aside could not be put back: rename %s to %s (%s)", dst, src, exc)
    return False


def _holds(f: io.BufferedReader, size: int, expect: bytes | memoryview) -> bool:
    """Whether the open file `f` of `size` bytes holds exactly `expect`."""
    want = memoryview(expect).cast("B")
    if size != want.nbytes:
        return False
    step = 1 << 22
    view = memoryview(bytearray(min(step, max(1, size))))
    for off in range(0, size, step):
        n = min(step, size - off)
        if f.readinto(view[:n]) != n or view[:n] != want[off : off + n]:
            return False
    return True


def _put_back(moved: Path, path: Path) -> None:
    """Return a file moved aside to `path`, unless another file is there by now (it is
    newer: it stays and the moved one goes)."""
    try:
        os.link(moved, path)
    except FileExistsError:
        pass
    except OSError:  # no hard links here: a rename, which a file landing at `path` meanwhile would lose
        if not os.path.exists(path):
            os.replace(moved, path)
            return
    os.unlink(moved)
