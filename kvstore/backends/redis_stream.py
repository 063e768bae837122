"""Big Redis values read straight into their destination: one copy, from the socket.

Owns: `RespStreams`, a few raw non-blocking sockets to one Redis server (TCP or unix
socket), authenticated and on the right database, that send ``GET`` and receive the
bulk reply with ``loop.sock_recv_into`` into the buffer a `StreamSink` names, handing
each received block to the sink while it is still in cache; and that send ``SET`` with
the value's parts straight from the caller's memory.  redis-py (with hiredis) copies a
big reply three times before the caller sees it, and joins a big value before sending
it; these copy once and not at all.  Must
not touch: key layout (the backend passes keys), frames (the sink), redis-py's pool.

Plain TCP and unix sockets only, no Cluster: `RedisBackend` keeps redis-py's path for
TLS and Cluster.  A socket whose reply was not read to the end (an error, a deadline,
a cancel) is closed, never reused.  Everything runs on the event loop, so cancelling a
read stops every write into the destination at once.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.backends.stream import StreamSink

LINE_MAX = 64  # "$<length>\r\n" and short error lines fit
DRAIN_BLOCK = 1 << 20


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


class Manifest(bytes):
    """A small value that announced itself as a multi-part manifest (the caller decodes it)."""


class RespStreams:
    """Raw RESP connections for streamed GETs; at most `size` idle ones are kept."""

    def __init__(
        self,
        address: Address,
        *,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        size: int = 4,
        connect_timeout: float = 1.0,
    ) -> None:
        self.address = address
        self.username = username
        self.password = password
        self.db = db
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
            hello = b""
            if self.password:
                creds = [self.username.encode(), self.password.encode()] if self.username else [self.password.encode()]
                hello += pack(b"AUTH", *creds)
            if self.db:
                hello += pack(b"SELECT", str(self.db).encode())
            if hello:
                await loop.sock_sendall(sock, hello)
                for _ in range(hello.count(b"*")):
                    line = await _read_line(loop, sock)
                    if not line.startswith(b"+"):
                        raise RespError(f"Redis refused the connection setup: {line[:80]!r}")
        except BaseException:
            sock.close()
            raise
        return sock

    async def _take(self) -> socket.socket:
        return self._idle.pop() if self._idle else await self._connect()

    def _give(self, sock: socket.socket) -> None:
        if len(self._idle) < self.size:
            self._idle.append(sock)
        else:
            sock.close()

    def close(self) -> None:
        for s in self._idle:
            s.close()
        self._idle.clear()

    # -- the write -------------------------------------------------------------------
    async def stream_set(self, key: bytes, parts: Sequence[memoryview], px: int | None) -> bool:
        """SET `key` to the concatenation of `parts`, sent as they are (never joined);
        ``PX`` `px` when given.  False when Redis refuses it (e.g. out of memory)."""
        loop = asyncio.get_running_loop()
        n = sum(p.nbytes for p in parts)
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if px is not None else 3, len(key), key, n)
        tail = b"\r\n" + (b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px) if px is not None else b"")
        sock = await self._take()
        whole = False
        try:
            await loop.sock_sendall(sock, head)
            for part in parts:
                await loop.sock_sendall(sock, part)
            await loop.sock_sendall(sock, tail)
            line = await _read_line(loop, sock)
            whole = True
            return line == b"+OK"
        finally:
            if whole:
                self._give(sock)
            else:
                sock.close()

    # -- the read --------------------------------------------------------------------
    async def stream_get(self, key: bytes, sink: StreamSink, manifest_len: int) -> object:
        """GET `key` into what `sink` names; the sink's verdict, None when the key is
        absent or holds another type, or a `Manifest` (a multi-part value's manifest)."""
        loop = asyncio.get_running_loop()
        sock = await self._take()
        whole = False
        try:
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
                whole = have == pos
                return None
            if not line.startswith(b"$"):
                raise RespError(f"unexpected reply {line[:40]!r}")
            n = int(line[1:])
            if n < 0:
                whole = have == pos
                return None
            total = n + 2  # the value and its trailing CRLF
            got = have - pos  # reply bytes after the length line received so far
            if n == manifest_len:
                while got < total:
                    got += await _recv(loop, sock, mv[pos + got : pos + total])
                whole = True
                return Manifest(buf[pos : pos + n])
            want = min(n, sink.head)
            while got < want:
                got += await _recv(loop, sock, mv[pos + got : pos + max(want, min(total, len(buf) - pos))])
            where = sink.body(mv[pos : pos + want], n)
            if where is None:
                await _drain(loop, sock, total - got)
                whole = True
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
            whole = True
            return sink.finish()
        finally:
            if whole:
                self._give(sock)
            else:
                sock.close()


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


async def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(max(n, 1), DRAIN_BLOCK)))
    while n > 0:
        n -= await _recv(loop, sock, scratch[: min(n, len(scratch))])


__all__ = ["Address", "Manifest", "RespError", "RespStreams"]
