"""Which object files a disk tier's shard folders hold, kept current by the kernel (inotify).

Owns: `ObjectWatch`, the set of file names under ``ROOT/objects/<shard>/`` built by one
listing and then kept by Linux's inotify events (a rename into place or a create adds a
name; an unlink or a rename away removes it), so a lookup of names the store's books do
not hold costs one non-blocking ``read`` of pending events and set lookups, instead of
a ``stat`` per name (a 128-chunk prompt that misses: 128 stats).  Events are queued by
the kernel when the rename happens, in order, so a name published by any process before
`held` reads the queue is seen by it.  Must not touch: the files themselves (it only
lists and watches), the index, names (callers pass file names: `encode_filename`).

It answers nothing (None: stat instead) until its first listing is done (a worker
thread, `scan`), and never again after the kernel dropped events (its queue overflowed)
or a watched folder went away (the store was deleted under it): a lost event would be
a wrong answer, so it gives up and says why (`failed`); so it does past `MAX_NAMES`
names.  Names with a ``.`` are not objects (temp files ``.<pid>-<n>.tmp``, side files
``~<digest>.name``: object file names escape ``.``) and are not kept.  Linux only
(`open` gives None elsewhere); where inotify cannot be had (``fs.inotify.max_user_instances``
or ``max_user_watches`` reached) `open` raises `OSError`.  One watch is 256 watches and
one inotify instance of the user's.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from collections.abc import Iterable, Sequence

IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

ADDED = IN_MOVED_TO | IN_CREATE
REMOVED = IN_MOVED_FROM | IN_DELETE
GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED  # a watched folder is no more
WATCHED = ADDED | REMOVED | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
READ_SIZE = 1 << 16
MAX_NAMES = 1 << 22  # ~0.5 GiB of names: a store of more objects is not watched (lookups stat)


class ObjectWatch:
    """The object file names in a set of shard folders; see the module docstring."""

    def __init__(self, fd: int, folders: dict[int, str]) -> None:
        self._fd = fd
        self._folders = folders  # watch descriptor -> folder
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._ready = False
        self._pending: list[tuple[int, str]] | None = []  # events read while the first listing runs
        self.failed: str | None = None  # why it stopped answering, once it has

    @classmethod
    def open(cls, folders: Iterable[str]) -> ObjectWatch | None:
        """Watch `folders` (they must exist); None off Linux; `OSError` where inotify
        cannot be had (its limits reached, a folder gone)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:  # EMFILE: fs.inotify.max_user_instances reached
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        watched: dict[int, str] = {}
        for folder in folders:
            wd = add(fd, os.fsencode(folder), WATCHED)
            if wd < 0:  # ENOSPC: fs.inotify.max_user_watches reached
                err = ctypes.get_errno()
                os.close(fd)
                raise OSError(err, os.strerror(err), folder)
            watched[wd] = folder
        return cls(fd, watched)

    def fileno(self) -> int:
        return self._fd

    @property
    def ready(self) -> bool:
        """It answers now (listed, not failed)."""
        return self._ready

    def scan(self) -> None:
        """List every folder (blocking: run it on a worker thread), then answer from the
        listing and the events read since the watches were set, in order."""
        names: set[str] = set()
        try:
            for folder in self._folders.values():
                with os.scandir(folder) as entries:
                    names.update(e.name for e in entries if "." not in e.name)
        except OSError as exc:
            with self._lock:
                self._fail(f"listing {exc.filename} failed: {exc.strerror}")
            return
        if len(names) > MAX_NAMES:
            with self._lock:
                self._fail(f"more than {MAX_NAMES} objects to keep in memory")
            return
        with self._lock:
            self._read()
            pending, self._pending = self._pending, None
            if self.failed is not None or pending is None:
                return
            for mask, name in pending:
                if mask & ADDED:
                    names.add(name)
                else:
                    names.discard(name)
            self._names = names
            self._ready = True

    def drain(self) -> None:
        """Read the events pending (the event loop calls this when the fd is readable, so
        the kernel's queue never fills while nobody looks anything up)."""
        with self._lock:
            self._read()

    def held(self, filenames: Sequence[str]) -> list[bool] | None:
        """Whether a file of each name is in the folders now, or None (not ready, failed)."""
        with self._lock:
            if not self._ready:
                return None
            self._read()
            if not self._ready:
                return None
            names = self._names
            return [f in names for f in filenames]

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._ready = False
            self.failed = self.failed or "closed"

    # -- under the lock ----------------------------------------------------------------
    def _read(self) -> None:
        while self._fd >= 0 and self.failed is None:
            try:
                data = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(f"reading file events failed: {exc.strerror}")
                return
            self._apply(data)

    def _apply(self, data: bytes) -> None:
        at, end = 0, len(data)
        pending, names = self._pending, self._names
        while at < end:
            wd, mask, _cookie, size = _EVENT.unpack_from(data, at)
            at += _EVENT.size
            raw = data[at : at + size]
            at += size
            if mask & IN_Q_OVERFLOW:
                self._fail("the kernel's event queue overflowed (fs.inotify.max_queued_events)")
                return
            if mask & GONE:
                self._fail(f"{self._folders.get(wd, 'a watched folder')} was removed or moved")
                return
            if mask & IN_ISDIR:
                continue
            name = raw.rstrip(b"\0").decode("utf-8", "surrogateescape")
            if "." in name:
                continue
            if pending is not None:
                pending.append((mask, name))
            elif mask & ADDED:
                names.add(name)
                if len(names) > MAX_NAMES:
                    self._fail(f"more than {MAX_NAMES} objects to keep in memory")
                    return
            else:
                names.discard(name)

    def _fail(self, why: str) -> None:
        self.failed = why
        self._ready = False
        self._pending = None
        self._names = set()


__all__ = ["ObjectWatch"]
