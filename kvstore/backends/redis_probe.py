"""A Redis lookup answered on the caller's thread: one blocking socket, one round trip.

Owns: `RespProbe`, a blocking RESP connection (TCP or unix socket, authenticated and on
the right database) that any thread may use, one at a time, to ask the ``TYPE`` of a
few keys in one round trip, waiting at most `timeout` per step.  A lookup that misses
the store's books asks the tier (someone else may have stored the chunk); on LMCache's
thread that ask costs two thread hops and the event loop's layers, several times the
round trip itself.  Must not touch: key layout (the backend passes keys), the event
loop's sockets (`kvstore.backends.redis_stream`), when to ask (the backend's
`InlineGate`).

A socket whose reply was not read whole (an error, a timeout) is closed, never reused;
an idle one the server closed (a restart, its idle ``timeout``) is replaced before use.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from kvstore.backends.redis_stream import NO_LOGIN, Address, Login, RespError, pack


class RespProbe:
    """Short commands on one blocking socket from any thread; a busy probe says so (None)."""

    def __init__(
        self,
        address: Address,
        login: Login = NO_LOGIN,
        *,
        timeout: float = 0.005,
    ) -> None:
        self.address = address
        self.login = login
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False

    def types(self, keys: Sequence[bytes]) -> list[bytes] | None:
        """``TYPE`` of each key (``b"string"``, ``b"none"``, ...) in one round trip, or None
        when another thread is using the probe or it is closed.  Raises `OSError` (``TimeoutError`` past
        `timeout` a step; `RespError` when the server answers an error or breaks the
        protocol); the socket is dropped then."""
        if not keys:
            return []
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                return None
            idle, self._sock = self._sock, None  # it comes back only with its reply read whole
            sock = self._usable(idle) or self._connect()
            try:
                sock.sendall(b"".join(pack(b"TYPE", k) for k in keys))
                lines = _read_lines(sock, len(keys))
            except BaseException:
                sock.close()
                raise
            bad = next((line for line in lines if not line.startswith(b"+")), None)
            if bad is not None:  # the server may be closing the socket after an error
                sock.close()
                raise RespError(f"Redis answered TYPE with {bad[:80]!r}")
            self._sock = sock
            return [line[1:] for line in lines]
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the socket, after the call in flight (at most its timeouts); not reopened."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket:
        a = self.address
        sock = socket.socket(a.family(), socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(a.path if a.path else (a.host, a.port))
            if not a.path:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setup = self.login.hello()
            if setup:
                sock.sendall(b"".join(setup))
                for line in _read_lines(sock, len(setup)):
                    if not line.startswith(b"+"):
                        raise RespError(f"Redis refused the connection setup: {line[:80]!r}")
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def _usable(sock: socket.socket | None) -> socket.socket | None:
        """`sock` if it is open and quiet (nothing to read, as an idle socket must be), else
        None (closed by the server, reset, or holding bytes nobody asked for; closed here)."""
        if sock is None:
            return None
        timeout = sock.gettimeout()
        sock.settimeout(0)  # with a timeout set, even a MSG_DONTWAIT recv would wait for it
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            sock.settimeout(timeout)
            return sock
        except OSError:
            pass
        sock.close()
        return None


def _read_lines(sock: socket.socket, n: int) -> list[bytes]:
    """The next `n` one-line replies, read in blocks; anything past them breaks the protocol."""
    buf = b""
    lines: list[bytes] = []
    while len(lines) < n:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise RespError("Redis closed the connection mid-reply")
        *done, buf = (buf + chunk).split(b"\r\n")
        lines += done
    if buf or len(lines) != n:
        raise RespError("Redis sent more than the replies asked for")
    return lines


__all__ = ["RespProbe"]
