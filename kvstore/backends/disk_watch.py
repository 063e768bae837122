"""Which object files a disk tier's shard folders hold, kept current by the kernel (inotify).

Owns: `ObjectWatch`, the set of file names under ``ROOT/objects/<shard>/`` built by one
listing and then kept by Linux's inotify events (a rename into place or a create adds a
name; an unlink or a rename away removes it), so a lookup of names the store's books do
not hold costs a ``poll`` of the event queue (a ``read`` when events are pending) and
set lookups, instead of a ``stat`` per name (a 128-chunk prompt that misses: 128 stats).  Events are queued by
the kernel when the rename happens, in order, so a name published by any process before
`held` reads the queue is seen by it.  Must not touch: the files themselves (it only
lists and watches), the index, names (callers pass file names: `encode_filename`).

It answers nothing (None: stat instead) until its first listing is done (`keep`, on
a thread of its own, which then reads events as they come), nor while it lists again
after the kernel dropped events (its queue overflowed: a lost event would be a wrong
answer; at most `MAX_LISTINGS` times an hour), and never again once the store's folders went
away or moved (a shard folder, ``objects/`` or the root deleted or renamed, or the
``objects/`` path naming another folder now), past `MAX_NAMES` names, or in a child
process after a fork: it closes its inotify instance and says why (`failed`).  Names with a ``.`` are not objects (temp files ``.<pid>-<n>.tmp``, side files
``~<digest>.name``: object file names escape ``.``) and are not kept.  Linux only
(`open` gives None elsewhere); where inotify cannot be had (``fs.inotify.max_user_instances``
or ``max_user_watches`` reached) `open` raises `OSError`.  One watch is 256 watches and
one inotify instance of the user's.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

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
GUARDED = IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR  # the folders above the shards: only their own fate
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
READ_SIZE = 1 << 16
MAX_NAMES = 1 << 22  # ~0.5 GiB of names: a store of more objects is not watched (lookups stat)
MAX_LISTINGS = 8  # listings (the first, and after overflows) within LISTINGS_WINDOW_S; then it gives up
LISTINGS_WINDOW_S = 3600.0
POLL_MS = 250  # `keep` checks the objects folder's identity, and for its end, this often
_LIVE: weakref.WeakSet[ObjectWatch] = weakref.WeakSet()


class ObjectWatch:
    """The object file names in a set of shard folders; see the module docstring."""

    def __init__(self, fd: int, folders: dict[int, str], guards: dict[int, str]) -> None:
        self._fd = fd
        self._poll = select.poll()  # whether events are pending (`_read`)
        self._poll.register(fd, select.POLLIN)
        self._folders = folders  # watch descriptor -> shard folder
        self._guards = guards  # watch descriptor -> a folder above them
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._ready = False
        self._pending: list[tuple[int, str]] | None = []  # events read while a listing runs
        self._listed_at: list[float] = []  # when the listings within LISTINGS_WINDOW_S began
        self._overflows = 0  # a listing that began before the last overflow is void
        self.failed: str | None = None  # why it stopped answering for good, once it has
        _LIVE.add(self)

    @classmethod
    def open(cls, folders: Iterable[str], guards: Iterable[str] = ()) -> ObjectWatch | None:
        """Watch the shard `folders` and the folders above them (`guards`: only for being
        deleted or moved); they must exist.  None off Linux; `OSError` where inotify
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
        watched: list[dict[int, str]] = [{}, {}]
        for kind, (paths, mask) in enumerate(((folders, WATCHED), (guards, GUARDED))):
            for folder in paths:
                wd = add(fd, os.fsencode(folder), mask)
                if wd < 0:  # ENOSPC: fs.inotify.max_user_watches reached
                    err = ctypes.get_errno()
                    os.close(fd)
                    raise OSError(err, os.strerror(err), folder)
                watched[kind][wd] = folder
        return cls(fd, watched[0], watched[1])

    @property
    def ready(self) -> bool:
        """It answers now (listed, not failed)."""
        return self._ready

    def keep(self, objects: str, listed: Callable[[], object]) -> None:
        """List the folders, then read events as they come (so the kernel's queue does not
        fill while nobody looks anything up), list again after an overflow, and check
        every `POLL_MS` that `objects` still names the folder the shards are in; until
        `close` or a failure.  `listed` is called once the watch answers or never will.
        Blocking: a thread of its own."""
        try:
            ino = _inode(objects)
            poller = select.poll()
            with self._lock:
                if self._fd >= 0:
                    poller.register(self._fd, select.POLLIN)
            while self.failed is None:
                if self._pending is not None:  # not listed yet, or events were dropped
                    self.scan()
                if self._ready:
                    listed()
                if poller.poll(POLL_MS):
                    self.drain()
                if self.failed is None and _inode(objects) != ino:
                    self.fail(f"{objects} names another folder now (the store was moved or deleted)")
        except Exception as exc:  # the watch must not outlive its thread: nobody would read it
            self.fail(f"watching failed: {type(exc).__name__}: {exc}")
        finally:
            listed()

    def scan(self) -> None:
        """List every shard folder, then answer from the listing and the events read
        since the listing began, in order (a name's last event decides it)."""
        with self._lock:
            if self.failed is not None:
                return
            now = time.monotonic()
            self._listed_at = [t for t in self._listed_at if now - t < LISTINGS_WINDOW_S] + [now]
            if len(self._listed_at) > MAX_LISTINGS:
                self._fail(
                    f"the kernel's event queue overflowed {self._overflows} times, {MAX_LISTINGS} within "
                    f"{LISTINGS_WINDOW_S / 3600:.0f} h (fs.inotify.max_queued_events)"
                )
                return
            # Everything read so far is older than the listing, which sees its effect; read
            # the queue to its end (an overflow event the kernel queued stays there until
            # read, and while it does, further drops add no new one), then keep only what
            # comes after: any drop from now on queues a fresh overflow event.
            self._read()
            if self.failed is not None:
                return
            self._pending = []
            overflows = self._overflows
        names: set[str] = set()
        try:
            for folder in self._folders.values():
                with os.scandir(folder) as entries:
                    names.update(e.name for e in entries if "." not in e.name and not e.is_dir(follow_symlinks=False))
                with self._lock:
                    if self._fd < 0:  # closed (or failed) meanwhile: stop listing
                        return
                    self._read()  # into `_pending`: the queue must not fill while this lists
                if len(names) > MAX_NAMES:
                    self.fail(f"more than {MAX_NAMES} objects to keep in memory")
                    return
        except OSError as exc:
            self.fail(f"listing {exc.filename} failed: {exc.strerror}")
            return
        with self._lock:
            self._read()
            pending = self._pending
            if self.failed is not None or pending is None or self._overflows != overflows:
                return  # failed, or the kernel dropped events while it listed: list again
            for mask, name in pending:
                if mask & ADDED:
                    names.add(name)
                else:
                    names.discard(name)
            self._names, self._pending, self._ready = names, None, True

    def drain(self) -> None:
        """Read the events pending."""
        with self._lock:
            self._read()

    def held(self, filenames: Sequence[str]) -> list[bool] | None:
        """Whether a file of each name is in the folders now, or None (not listed yet,
        listing again, failed)."""
        with self._lock:
            if not self._ready:
                return None
            self._read()
            if not self._ready:
                return None
            names = self._names
            return [f in names for f in filenames]

    def fail(self, why: str) -> None:
        """Stop answering for good, and give the inotify instance back."""
        with self._lock:
            self._fail(why)

    def close(self) -> None:
        self.fail("closed")

    # -- under the lock ----------------------------------------------------------------
    def _read(self) -> None:
        # poll first: a read of an empty queue raises BlockingIOError, which costs a
        # lookup 3 µs where the poll costs 0.6 (most lookups find nothing pending)
        while self._fd >= 0 and self._poll.poll(0):
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
        while at < end and self._fd >= 0:
            wd, mask, _cookie, size = _EVENT.unpack_from(data, at)
            at += _EVENT.size
            raw = data[at : at + size]
            at += size
            if mask & IN_Q_OVERFLOW:  # events were dropped: list again, keeping what follows
                self._overflows += 1
                self._ready, self._pending, self._names = False, [], set()
                continue
            if mask & GONE:
                self._fail(f"{self._folders.get(wd) or self._guards.get(wd) or 'a watched folder'} was removed or moved")
                return
            if mask & IN_ISDIR:
                continue
            name = raw.rstrip(b"\0").decode("utf-8", "surrogateescape")
            if "." in name:
                continue
            if self._pending is not None:
                self._pending.append((mask, name))
            elif mask & ADDED:
                self._names.add(name)
                if len(self._names) > MAX_NAMES:
                    self._fail(f"more than {MAX_NAMES} objects to keep in memory")
                    return
            else:
                self._names.discard(name)

    def _fail(self, why: str) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._ready, self._pending, self._names = False, None, set()
        if self.failed is None:
            self.failed = why  # last: a reader seeing it sees the rest done


def _inode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _forked() -> None:
    """In a child after fork: the inotify instance is shared with the parent, whose events
    this process must not take; close this process's descriptor of it (the parent's stays)."""
    for watch in list(_LIVE):
        watch._lock = threading.Lock()  # another thread may have held it at the fork
        watch._fail("this process was forked from the one that watches")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


__all__ = ["ObjectWatch"]
