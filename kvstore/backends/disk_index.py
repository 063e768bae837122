"""The shared index of a disk store: ``ROOT/index.sqlite3`` (SQLite, WAL mode).

Owns: one row per object (name, size, last access, and while a write is in flight its
writer and lease), the store's running totals, and the transactions that keep one byte
budget and one LRU order for every process that opens the same directory.  Must not
touch: object bytes, name escaping (the backend hands in callbacks for the file system).

* One connection per backend, used only from the index's own thread (``submit``/``run``),
  so the event loop never waits on SQLite; ``busy_timeout`` lets processes queue for the
  write lock instead of failing.
* A put *reserves* its bytes: one ``BEGIN IMMEDIATE`` transaction (one for the puts a
  batch begins together: `reserve_many`) applies the reads and publishes this process
  has batched, evicts least recently used rows that nobody is writing (and that this
  process is not reading) until the new object fits, and inserts its row with a lease.
  Where evicting all of those would not make room, none is evicted: the put waits for a
  write to finish.  A fault inside the transaction rolls it back whole (every put of the
  batch fails; a victim's file already removed is a row without a file, dropped when
  found).  Every process's reservations count against the same total, so
  on-disk bytes exceed the budget by at most the writes in flight (a write's temp file
  beside the object it replaces).
* The objects on disk are the truth and the index a cache of them: a store without an
  index (an older kvstore, an index deleted or corrupt) is indexed by one directory walk
  in the index thread; a row without a file is dropped when found, a file without a row
  is adopted when found.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

INDEX_FILE = "index.sqlite3"
LEASE_S = 120.0  # a write not published by then is treated as abandoned (its writer died)
BUSY_TIMEOUT_MS = 30_000
VERSION = "1"

OK, WAIT, FULL = "ok", "wait", "full"

_SCHEMA = (
    "CREATE TABLE objects (name TEXT PRIMARY KEY, size INTEGER NOT NULL, atime REAL NOT NULL,"
    " writer TEXT, lease REAL NOT NULL DEFAULT 0) WITHOUT ROWID",
    "CREATE INDEX objects_lru ON objects (atime)",
    "CREATE TABLE totals (id INTEGER PRIMARY KEY CHECK (id = 0), objects INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT INTO totals VALUES (0, 0, 0)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TRIGGER objects_ins AFTER INSERT ON objects BEGIN"
    " UPDATE totals SET objects = objects + 1, bytes = bytes + NEW.size WHERE id = 0; END",
    "CREATE TRIGGER objects_del AFTER DELETE ON objects BEGIN"
    " UPDATE totals SET objects = objects - 1, bytes = bytes - OLD.size WHERE id = 0; END",
    "CREATE TRIGGER objects_upd AFTER UPDATE OF size ON objects BEGIN"
    " UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 0; END",
)

Walk = Callable[[], Iterable[tuple[str, int, float]]]  # (name, size, mtime) of every object on disk
Unlink = Callable[[str], bool]  # remove an object's file: True if it is gone, False if it cannot be
Stat = Callable[[str], int | None]  # an object's size on disk, None if it is not there


class DiskIndex:
    def __init__(self, path: Path, walk: Walk, unlink: Unlink, stat: Stat) -> None:
        self.path = path
        self._walk = walk
        self._unlink = unlink
        self._stat = stat
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk-index")
        self._conn: sqlite3.Connection | None = None
        self._inode = 0
        self.memory = False  # the index could not be opened on disk: a private one in memory
        self.objects = 0  # totals as of the last transaction (every process's rows)
        self.bytes = 0
        self.complete = False  # every file on disk has been indexed once
        self.rebuilt = 0  # how many directory walks this index has done
        self._shut = False  # closed: no job reopens the index (one queued behind the close)

    # ---- threading ------------------------------------------------------------
    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._exec.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._exec.submit(fn, *args))

    def close(self) -> None:
        def shut() -> None:
            self._shut = True
            if self._conn is not None:
                try:
                    self._forget_if_empty(self._conn)
                except (sqlite3.Error, OSError) as exc:
                    log.debug("kvstore disk: index %s: %s", self.path, exc)
                self._conn.close()
                self._conn = None

        self._exec.submit(shut).result()
        self._exec.shutdown(wait=True)

    def _forget_if_empty(self, conn: sqlite3.Connection) -> None:
        """An empty store keeps no index: removed under the write lock, so a process that
        still has it open sees it gone at its next call and starts a new one."""
        if self.memory:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("SELECT count(*) FROM objects").fetchone()[0] == 0:
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.unlink(f"{self.path}{suffix}")
                    except FileNotFoundError:
                        pass
        finally:
            conn.execute("ROLLBACK")

    # ---- opening --------------------------------------------------------------
    def connect(self) -> None:
        """Open (creating if needed) the index; one set aside if it cannot be read.  Cheap:
        no walk (see `open`).  Safe to call from any thread before the index thread runs."""
        try:
            self._connect()
            return
        except sqlite3.DatabaseError as exc:
            corrupt = getattr(exc, "sqlite_errorname", "") in ("SQLITE_NOTADB", "SQLITE_CORRUPT")
            if not (corrupt and self._set_aside(exc)):
                self._private(exc)
                return
        try:
            self._connect()
        except sqlite3.Error as exc:
            self._private(exc)

    def _private(self, exc: Exception) -> None:
        """The index cannot be opened (a read-only store): this process keeps one of its own."""
        log.warning(
            "kvstore disk: index %s cannot be opened (%s); this process indexes the store alone",
            self.path,
            exc,
        )
        self.memory = True
        self._connect()

    def _connect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if not self.memory:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            ":memory:" if self.memory else self.path,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            if not conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'totals'").fetchone()[0]:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if not conn.execute(
                        "SELECT count(*) FROM sqlite_master WHERE name = 'totals'"
                    ).fetchone()[0]:
                        for stmt in _SCHEMA:
                            conn.execute(stmt)
                        conn.execute("INSERT INTO meta VALUES ('version', ?)", (VERSION,))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            row = conn.execute("SELECT value FROM meta WHERE key = 'complete'").fetchone()
            self.complete = row is not None
            self.objects, self.bytes = conn.execute("SELECT objects, bytes FROM totals").fetchone()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._inode = 0 if self.memory else os.stat(self.path).st_ino

    def _set_aside(self, exc: Exception) -> bool:
        dst = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time() * 1000)}")
        log.warning(
            "kvstore disk: index %s cannot be read (%s); set aside as %s and rebuilt", self.path, exc, dst
        )
        try:
            os.replace(self.path, dst)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        for side in ("-wal", "-shm"):
            try:
                os.unlink(f"{self.path}{side}")
            except OSError:
                pass
        return True

    def open(self, capacity: int | None) -> None:
        """In the index thread: index the files on disk if that was never done (or the index
        was lost), then evict down to `capacity` if the store is over it."""
        if not self.complete:
            self._rebuild()
        if capacity is not None and self.bytes > capacity:
            self.reserve(None, 0, "", frozenset(), capacity, {}, [])

    def _rebuild(self) -> None:
        t0 = time.monotonic()
        found = sorted(self._walk())  # in key order: inserts append to the B-tree (~3x faster)
        now = time.time()
        for start in range(0, len(found), 20_000):  # short transactions: other processes go on
            with self._tx() as c:
                c.executemany(
                    "INSERT OR IGNORE INTO objects (name, size, atime) VALUES (?, ?, ?)",
                    found[start : start + 20_000],
                )
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES ('complete', ?)", (str(now),))
        self.complete = True
        self.rebuilt += 1
        log.info("kvstore disk: indexed %d objects in %.2fs", len(found), time.monotonic() - t0)

    def _db(self) -> sqlite3.Connection:
        """The connection; reopened (and the store re-indexed) if the index file was removed
        underneath (the store's directory deleted while running)."""
        try:
            same = self.memory or os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            same = False
        except OSError:
            same = True
        if self._shut:
            raise RuntimeError(f"kvstore disk: index {self.path} is closed")
        if not same or self._conn is None:
            self.connect()
            if not self.complete:
                self._rebuild()
        assert self._conn is not None
        return self._conn

    @contextmanager
    def _tx(self) -> Any:
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            self.objects, self.bytes = conn.execute("SELECT objects, bytes FROM totals").fetchone()
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # ---- batched bookkeeping ----------------------------------------------------
    def _apply(
        self, c: sqlite3.Connection, touches: dict[str, float], published: list[tuple[str, int, str]]
    ) -> None:
        now = time.time()
        for name, size, writer in published:
            cur = c.execute(
                "UPDATE objects SET size = ?, writer = NULL, lease = 0 WHERE name = ? AND writer = ?",
                (size, name, writer),
            )
            if not cur.rowcount and self._stat(name) is not None:
                # its row was evicted (lease over) or deleted while it was written: adopt the file
                c.execute(
                    "INSERT INTO objects (name, size, atime) VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING",
                    (name, size, now),
                )
        for name, atime in touches.items():
            cur = c.execute("UPDATE objects SET atime = max(atime, ?) WHERE name = ?", (atime, name))
            if not cur.rowcount:
                found = self._stat(name)
                if found is not None:  # a file without a row: adopt it
                    c.execute(
                        "INSERT INTO objects (name, size, atime) VALUES (?, ?, ?)", (name, found, atime)
                    )

    def flush(
        self,
        touches: dict[str, float],
        published: list[tuple[str, int, str]],
        adopt: set[str],
        missing: set[str],
    ) -> None:
        """Apply what reads, contains and writes of this process found since the last flush."""
        self._db()
        now = time.time()
        with self._tx() as c:
            self._apply(c, touches, published)
            for name in adopt:
                if c.execute("SELECT 1 FROM objects WHERE name = ?", (name,)).fetchone() is None:
                    size = self._stat(name)
                    if size is not None:
                        c.execute(
                            "INSERT INTO objects (name, size, atime) VALUES (?, ?, ?)", (name, size, now)
                        )
            for name in missing:
                row = c.execute("SELECT lease FROM objects WHERE name = ?", (name,)).fetchone()
                if row is not None and row[0] < now and self._stat(name) is None:  # a row without a file
                    self._delete(c, name)

    def _delete(self, c: sqlite3.Connection, name: str) -> None:
        c.execute("DELETE FROM objects WHERE name = ?", (name,))

    def drop(self, names: list[str]) -> None:
        """Forget objects whose files this process removed or found gone."""
        self._db()
        with self._tx() as c:
            for name in names:
                self._delete(c, name)

    # ---- the budget -------------------------------------------------------------
    def reserve(
        self,
        name: str | None,
        size: int,
        writer: str,
        reading: frozenset[str],
        capacity: int | None,
        touches: dict[str, float],
        published: list[tuple[str, int, str]],
    ) -> tuple[str, list[str]]:
        """Make room for `size` bytes of `name` and reserve them: (OK | WAIT | FULL, the
        names evicted).

        WAIT: over budget, and evicting every object nobody is writing (or is read here)
        would not make room: none is evicted; ask again when a write finishes.  FULL: a
        victim's file could not be removed (victims removed before it stay removed), or no
        write or read under way could free what is missing.  `name` None only evicts down
        to capacity, as far as it can.
        """
        self._db()
        with self._tx() as c:
            self._apply(c, touches, published)
            return self._reserve_in(c, name, size, writer, reading, capacity, time.time())

    def reserve_many(
        self,
        asks: list[tuple[str, int, str]],
        reading: frozenset[str],
        capacity: int | None,
        touches: dict[str, float],
        published: list[tuple[str, int, str]],
    ) -> list[tuple[str, list[str]]]:
        """`reserve` for each (name, size, writer) of `asks`, in order, in one transaction:
        each one's (status, names evicted for it)."""
        self._db()
        now = time.time()
        with self._tx() as c:
            self._apply(c, touches, published)
            return [self._reserve_in(c, name, size, writer, reading, capacity, now) for name, size, writer in asks]

    def _reserve_in(
        self,
        c: sqlite3.Connection,
        name: str | None,
        size: int,
        writer: str,
        reading: frozenset[str],
        capacity: int | None,
        now: float,
    ) -> tuple[str, list[str]]:
        evicted: list[str] = []
        old = 0
        if name is not None:
            row = c.execute("SELECT size FROM objects WHERE name = ?", (name,)).fetchone()
            old = row[0] if row is not None else 0
        need = self.bytes_now(c) - old + size
        status = OK
        if capacity is not None and need > capacity:
            victims, short, passed = self._victims(c, name, reading, need - capacity, now)
            if short and name is not None:  # evicting all it may would not make room: none
                victims = []
            for victim in victims:
                if not self._unlink(victim):
                    status = FULL
                    break
                self._delete(c, victim)
                evicted.append(victim)
            if status == OK and short:
                busy = c.execute("SELECT count(*) FROM objects WHERE lease >= ?", (now,)).fetchone()[0]
                status = WAIT if busy or passed or reading else FULL
        if status == OK and name is not None:
            c.execute(
                "INSERT INTO objects (name, size, atime, writer, lease) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET size = excluded.size, atime = excluded.atime,"
                " writer = excluded.writer, lease = excluded.lease",
                (name, size, now, writer, now + LEASE_S),
            )
        return status, evicted

    @staticmethod
    def bytes_now(c: sqlite3.Connection) -> int:
        return int(c.execute("SELECT bytes FROM totals").fetchone()[0])

    def _victims(
        self, c: sqlite3.Connection, name: str | None, reading: frozenset[str], room: int, now: float
    ) -> tuple[list[str], bool, bool]:
        """The least recently used rows nobody is writing and this process is not reading,
        oldest first, until they free `room` bytes: (their names, whether they fall short
        of it, whether a row was passed over because this process reads it)."""
        out: list[str] = []
        freed = 0
        passed = False
        rows = c.execute("SELECT name, size FROM objects WHERE lease < ? ORDER BY atime", (now,))
        try:
            for victim, vsize in rows:
                if victim == name:
                    continue
                if victim in reading:
                    passed = True
                    continue
                out.append(victim)
                freed += vsize
                if freed >= room:
                    break
        finally:
            rows.close()
        return out, freed < room, passed

    def unreserve(self, name: str, writer: str) -> None:
        """A write failed: its reservation goes, leaving the row of whatever file is there."""
        self._db()
        with self._tx() as c:
            row = c.execute("SELECT writer FROM objects WHERE name = ?", (name,)).fetchone()
            if row is None or row[0] != writer:
                return
            size = self._stat(name)
            if size is None:
                self._delete(c, name)
            else:
                c.execute(
                    "UPDATE objects SET size = ?, writer = NULL, lease = 0 WHERE name = ?", (size, name)
                )

    def sizes(self, names: list[str]) -> dict[str, int]:
        self._db()
        assert self._conn is not None
        out: dict[str, int] = {}
        for name in names:
            row = self._conn.execute("SELECT size FROM objects WHERE name = ?", (name,)).fetchone()
            if row is not None:
                out[name] = row[0]
        return out
