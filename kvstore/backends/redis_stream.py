"""Big Redis values read straight into their destination: one copy, from the socket.

Owns: `RespStreams`, a few raw non-blocking sockets to one Redis server (TCP or unix
socket), authenticated and on the right database, that send ``GET`` and receive the
bulk reply with ``loop.sock_recv_into`` into the buffer a `StreamSink` names, handing
each received block to the sink while it is still in cache; and that send ``SET`` with
the value's parts straight from the caller's memory.  redis-py (with hiredis) copies a
big reply three times before the caller sees it, and joins a big value before sending
it; these copy once and not at all.  A value whose first bytes depend on a checksum of
the rest (an unsealed frame) is sent once, each block hashed just before it goes out,
under a temporary key, then patched and renamed into place in one server-side script
(`stream_set_patched`).  Must not touch: key layout (the backend passes keys), frames
(the sink; the caller's ``patch``), redis-py's pool.

Plain TCP and unix sockets only, no Cluster: `RedisBackend` keeps redis-py's path for
TLS and Cluster.  A socket whose reply was not read to the end (an error, a deadline,
a cancel) is closed, never reused.  Everything runs on the event loop, so cancelling a
read stops every write into the destination at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.backends.stream import StreamSink
from kvstore.checksum import crc32c

LINE_MAX = 64  # "$<length>\r\n" and short error lines fit
DRAIN_BLOCK = 1 << 20
HASH_BLOCK = 1 << 20  # hashed just before it is sent: it and the kernel's copy of it stay in L2

#: Publishes a value sent under a temporary key: only a temporary key of the length sent
#: (a SET refused for memory, or a key evicted since, leaves none), its first bytes
#: overwritten in place (the value is not shared: SETRANGE copies nothing else), renamed
#: over the object, then the object's expiry set (all one step: readers see the old
#: value or the new one).  Commands: STRLEN, SETRANGE, RENAME, PERSIST / PEXPIRE.
PATCH_SCRIPT = b"""\
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('SETRANGE', KEYS[1], 0, ARGV[1])
redis.call('RENAME', KEYS[1], KEYS[2])
if ARGV[3] == '' then redis.call('PERSIST', KEYS[2]) else redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return 1
"""


class RespError(ConnectionError):
    """The server answered with an error or broke the protocol (the socket is dropped)."""


@dataclass(frozen=True)
class Address:
    host: str = ""
    port: int = 0
    path: str = ""  # unix socket

    def family(self) -> int:
        return socket.AF_UNIX if self.path else socket.AF_INET6 if ":" in self.host else socket.AF_INET


def pack(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


@dataclass(frozen=True)
class Login:
    """Who a new connection logs in as, and the database it selects."""

    username: str | None = None
    password: str | None = None
    db: int = 0

    def hello(self) -> list[bytes]:
        """The commands that set a new connection up (``AUTH``, ``SELECT``), each answered ``+OK``."""
        out = []
        if self.password:
            creds = [self.username.encode(), self.password.encode()] if self.username else [self.password.encode()]
            out.append(pack(b"AUTH", *creds))
        if self.db:
            out.append(pack(b"SELECT", str(self.db).encode()))
        return out


NO_LOGIN = Login()  # no AUTH, database 0


#: Errors that refuse one write, not the way it is written (memory, a busy or loading
#: server, a replica, a failing snapshot): that put fails, the next one tries again.  Also
#: found after " -": older servers wrap an error raised inside a script in their own text.
TRANSIENT = re.compile(rb"(?:^|\s)-(?:OOM|BUSY|LOADING|READONLY|MASTERDOWN|TRYAGAIN|NOREPLICAS|MISCONF)\b")


def refuses_the_way(reply: bytes) -> bool:
    """Does error `reply` refuse writing big values this way for good (a user without
    the temporary keys or ``EVAL``, a server or proxy without scripting, a command the
    script needs renamed away), rather than this one write?"""
    if not reply.startswith(b"-") or TRANSIENT.search(reply):
        return False
    text = reply.lower()
    return text.startswith(b"-noperm") or b"unknown command" in text or b"script" in text or b"lua" in text


class PatchRefused(RespError):
    """The server would not run the publishing script (no scripting, or not allowed to
    this user): send values whole instead.  The socket is fine."""


class Manifest(bytes):
    """A small value that announced itself as a multi-part manifest (the caller decodes it)."""


@dataclass
class _Lease:
    """A pooled socket lent for one command; ``whole``: its reply was read to the end."""

    sock: socket.socket
    whole: bool = False


class RespStreams:
    """Raw RESP connections for streamed GETs; at most `size` idle ones are kept."""

    def __init__(
        self,
        address: Address,
        login: Login = NO_LOGIN,
        *,
        size: int = 4,
        connect_timeout: float = 1.0,
    ) -> None:
        self.address = address
        self.login = login
        self.size = size
        self.connect_timeout = connect_timeout
        self._idle: list[socket.socket] = []

    # -- connections -----------------------------------------------------------------
    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        a = self.address
        sock = socket.socket(a.family(), socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            target: Any = a.path if a.path else (a.host, a.port)
            await asyncio.wait_for(loop.sock_connect(sock, target), self.connect_timeout)
            if not a.path:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setup = self.login.hello()
            if setup:
                await loop.sock_sendall(sock, b"".join(setup))
                for _ in range(len(setup)):
                    line = await _read_line(loop, sock)
                    if not line.startswith(b"+"):
                        raise RespError(f"Redis refused the connection setup: {line[:80]!r}")
        except BaseException:
            sock.close()
            raise
        return sock

    @contextlib.asynccontextmanager
    async def _lease(self) -> AsyncIterator[_Lease]:
        """An idle socket (or a new one) for one command; it goes back to the pool only
        when the body marked its reply read whole (``lease.whole``), else it is closed:
        a socket left mid-reply would hand its rest to the next command."""
        lease = _Lease(self._take_idle() or await self._connect())
        try:
            yield lease
        finally:
            if lease.whole and len(self._idle) < self.size:
                self._idle.append(lease.sock)
            else:
                lease.sock.close()

    def _take_idle(self) -> socket.socket | None:
        """An idle socket the server has not closed (an idle timeout, a restart, a killed
        client leave one that would fail the next command), or None."""
        while self._idle:
            sock = self._idle.pop()
            try:
                sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return sock  # nothing to read: open and quiet, as an idle socket must be
            except OSError:
                pass
            sock.close()  # closed by the server (an empty read), reset, or holding bytes nobody asked for
        return None

    def close(self) -> None:
        for s in self._idle:
            s.close()
        self._idle.clear()

    # -- lookups ---------------------------------------------------------------------
    async def types(self, keys: Sequence[bytes]) -> list[bytes]:
        """``TYPE`` of each key (``b"string"``, ``b"none"``, ...) in one round trip: what a
        lookup asks, without redis-py's per-command packing and parsing (most of a
        lookup's time through it).  `RespError` if the server answers with an error."""
        if not keys:
            return []
        loop = asyncio.get_running_loop()
        async with self._lease() as lease:
            await loop.sock_sendall(lease.sock, b"".join(pack(b"TYPE", k) for k in keys))
            lines = await _read_lines(loop, lease.sock, len(keys))
            bad = next((line for line in lines if not line.startswith(b"+")), None)
            lease.whole = bad is None  # after an error the server may be closing the socket: never reuse it
        if bad is not None:
            raise RespError(f"Redis answered TYPE with {bad[:80]!r}")
        return [line[1:] for line in lines]

    # -- the write -------------------------------------------------------------------
    async def stream_set(self, key: bytes, parts: Sequence[memoryview], px: int | None) -> bool:
        """SET `key` to the concatenation of `parts`, sent as they are (never joined);
        ``PX`` `px` when given.  False when Redis refuses it (e.g. out of memory)."""
        loop = asyncio.get_running_loop()
        n = sum(p.nbytes for p in parts)
        head, tail = _set_around(key, n, px)
        async with self._lease() as lease:
            sock = lease.sock
            await loop.sock_sendall(sock, head)
            for part in parts:
                await loop.sock_sendall(sock, part)
            await loop.sock_sendall(sock, tail)
            line = await _read_line(loop, sock)
            lease.whole = True
            return line == b"+OK"

    async def stream_set_patched(
        self,
        key: bytes,
        tmp: bytes,
        parts: Sequence[memoryview],
        px: int | None,
        tmp_px: int,
        patch: Callable[[int], memoryview],
    ) -> bool:
        """SET `key` to the concatenation of `parts` whose first part is final only once
        the others are sent: each block of the others is hashed (CRC32C, continued across
        parts) just before it goes out, while it is in cache, and ``patch(crc)`` then
        returns the first part's final bytes (the same length).  The value goes under
        `tmp` (expiring after `tmp_px` ms: a write cut short leaves nothing for long), and
        `PATCH_SCRIPT` writes the first part over it and renames it to `key` with expiry
        ``PX`` `px` (none when None), atomically.  False when Redis refuses this write
        (e.g. out of memory; `tmp` may be left, to expire); `PatchRefused` when its
        answer refuses this way of writing for good (`refuses_the_way`: no scripting for
        this client, an ACL that does not cover `tmp`, ...): send sealed values instead."""
        loop = asyncio.get_running_loop()
        n = sum(p.nbytes for p in parts)
        head, tail = _set_around(tmp, n, tmp_px)
        async with self._lease() as lease:
            sock = lease.sock
            await loop.sock_sendall(sock, head)
            await loop.sock_sendall(sock, parts[0])
            crc = 0
            for part in parts[1:]:
                for start in range(0, part.nbytes, HASH_BLOCK):
                    block = part[start : start + HASH_BLOCK]
                    crc = crc32c(block, crc)
                    await loop.sock_sendall(sock, block)
            first = patch(crc)
            if first.nbytes != parts[0].nbytes:
                raise ValueError(f"patch gave {first.nbytes} bytes for a first part of {parts[0].nbytes}")
            expiry = b"" if px is None else str(px).encode()
            await loop.sock_sendall(
                sock, tail + pack(b"EVAL", PATCH_SCRIPT, b"2", tmp, key, bytes(first), str(n).encode(), expiry)
            )
            stored = await _read_line(loop, sock)
            published = await _read_line(loop, sock)
            lease.whole = True
        for reply in (stored, published):
            if refuses_the_way(reply):
                raise PatchRefused(
                    f"Redis refused a write under a temporary key ({reply[1:161].decode('utf-8', 'replace')})"
                )
        return stored == b"+OK" and published == b":1"

    # -- the read --------------------------------------------------------------------
    async def stream_get(self, key: bytes, sink: StreamSink, manifest_len: int) -> object:
        """GET `key` into what `sink` names; the sink's verdict, None when the key is
        absent or holds another type, or a `Manifest` (a multi-part value's manifest)."""
        loop = asyncio.get_running_loop()
        async with self._lease() as lease:
            sock = lease.sock
            await loop.sock_sendall(sock, pack(b"GET", key))
            buf = bytearray(LINE_MAX + max(sink.head, manifest_len) + 2)
            mv = memoryview(buf)
            have = 0
            while (end := buf.find(b"\r\n", 0, have)) < 0:
                if have >= LINE_MAX:
                    raise RespError("reply line too long")
                have += await _recv(loop, sock, mv[have:LINE_MAX])
            line, pos = bytes(buf[:end]), end + 2
            if line.startswith(b"-"):  # e.g. WRONGTYPE: not a value of ours
                lease.whole = have == pos
                return None
            if not line.startswith(b"$"):
                raise RespError(f"unexpected reply {line[:40]!r}")
            n = int(line[1:])
            if n < 0:
                lease.whole = have == pos
                return None
            total = n + 2  # the value and its trailing CRLF
            got = have - pos  # reply bytes after the length line received so far
            if n == manifest_len:
                while got < total:
                    got += await _recv(loop, sock, mv[pos + got : pos + total])
                lease.whole = True
                return Manifest(buf[pos : pos + n])
            want = min(n, sink.head)
            while got < want:
                got += await _recv(loop, sock, mv[pos + got : pos + max(want, min(total, len(buf) - pos))])
            where = sink.body(mv[pos : pos + want], n)
            if where is None:
                await _drain(loop, sock, total - got)
                lease.whole = True
                return sink.finish()
            dst, offset = where
            k = 0  # payload bytes in dst
            if got > offset:  # payload bytes that came with the head
                k = min(got, offset + len(dst)) - offset
                dst[:k] = mv[pos + offset : pos + offset + k]
                sink.feed(dst[:k])
            elif got < offset:
                raise RespError("value header longer than the bytes the sink saw")
            while k < len(dst):
                r = await _recv(loop, sock, dst[k:])
                sink.feed(dst[k : k + r])
                k += r
            await _drain(loop, sock, total - max(got, offset + len(dst)))
            lease.whole = True
            return sink.finish()


def _set_around(key: bytes, n: int, px: int | None) -> tuple[bytes, bytes]:
    """The bytes of ``SET key <n-byte value> [PX px]`` before and after the value."""
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if px is not None else 3, len(key), key, n)
    tail = b"\r\n" + (b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px) if px is not None else b"")
    return head, tail


async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket, into: memoryview) -> int:
    r = await loop.sock_recv_into(sock, into)
    if r == 0:
        raise RespError("Redis closed the connection mid-reply")
    return r


async def _read_line(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\r\n"):
        chunk = await loop.sock_recv(sock, 1)
        if not chunk:
            raise RespError("Redis closed the connection")
        line += chunk
    return line[:-2]


async def _read_lines(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> list[bytes]:
    """The next `n` one-line replies (simple strings, integers, errors), read in blocks;
    anything past them (the server sends nothing unasked) breaks the protocol."""
    buf = b""
    lines: list[bytes] = []
    while len(lines) < n:
        chunk = await loop.sock_recv(sock, 1 << 16)
        if not chunk:
            raise RespError("Redis closed the connection mid-reply")
        *done, buf = (buf + chunk).split(b"\r\n")
        lines += done
    if buf or len(lines) != n:
        raise RespError("Redis sent more than the replies asked for")
    return lines


async def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(max(n, 1), DRAIN_BLOCK)))
    while n > 0:
        n -= await _recv(loop, sock, scratch[: min(n, len(scratch))])


__all__ = ["NO_LOGIN", "Address", "Login", "Manifest", "PatchRefused", "RespError", "RespStreams"]
